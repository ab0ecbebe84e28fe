"""Plan schema: YAML round trip, validation of malformed plans, the validate command."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elixir_tune.paths import CONFIGS_DIR
from elixir_tune.plan import (
    PlanError,
    dump_plan,
    load_plan,
    plan_to_dict,
    read_plan_dict,
    save_plan,
    validate,
    validate_dict,
)

EXAMPLE = CONFIGS_DIR / "plans" / "example.yaml"


@pytest.fixture
def raw() -> dict:
    return read_plan_dict(EXAMPLE)


def test_example_plan_is_valid():
    plan = load_plan(EXAMPLE)
    assert validate(plan) == []
    assert plan.world_size == 2
    assert plan.chunk_of()["transformer.wte.weight"] == 0


def test_round_trip_is_stable(tmp_path: Path):
    plan = load_plan(EXAMPLE)
    first = tmp_path / "first.yaml"
    save_plan(plan, first)
    again = load_plan(first)
    assert again == plan
    second = tmp_path / "second.yaml"
    save_plan(again, second)
    assert first.read_text() == second.read_text()


def test_round_trip_keeps_prediction_and_search(tmp_path: Path, raw: dict):
    raw["prediction"] = {
        "step_time_s": 1.5,
        "tokens_per_s": 1000.0,
        "tflops_per_gpu": 0.1,
        "mfu": 0.2,
        "peak_gpu_bytes": 10,
        "peak_host_bytes": 20,
        "model_state_bytes": {"cache_bytes": 1},
        "breakdown": {"compute_s": 1.0},
    }
    raw["search"] = {
        "strategy": "joint",
        "candidates": 3,
        "elapsed_s": 0.5,
        "alternatives": [{"cache_blocks": 2, "step_time_s": 1.7}],
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(raw))
    plan = load_plan(path)
    assert plan.prediction.breakdown == {"compute_s": 1.0}
    assert plan.search.alternatives[0]["cache_blocks"] == 2
    save_plan(plan, path)
    assert load_plan(path) == plan
    assert plan_to_dict(plan) == yaml.safe_load(dump_plan(plan))


def _set(raw: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = raw
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        last = int(last)
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value


_DELETE = object()

# (what is changed, value, the exact problem expected)
MALFORMED = [
    ("model.fingerprint", _DELETE, "model.fingerprint: missing (expected a string)"),
    ("model.num_params", "many", "model.num_params: expected an integer, got 'many'"),
    ("cluster.nodes", -1, "cluster.nodes: must be positive, got -1"),
    ("cluster.device", "tpu", "cluster.device: unknown value 'tpu' (expected one of cuda, cpu)"),
    ("training.dtype", "fp8", "training.dtype: unknown value 'fp8' (expected one of fp32, bf16, fp16)"),
    (
        "training.micro_batch_size",
        3,
        "training.global_batch_size: 16 is not micro_batch_size 3 x grad_accum_steps 2 x data-parallel size 2 = 12",
    ),
    ("memory.chunk_size", -65536, "memory.chunk_size: must be positive, got -65536"),
    ("memory.chunk_size", 65535, "memory.chunk_size: 65535 is not a multiple of the data-parallel size 2"),
    ("memory.cache_blocks", 3, "memory.cache_blocks: 3 is more than the 2 non-resident chunks"),
    ("memory.prefetch", True, "memory.prefetch: expected an integer, got True"),
    (
        "memory.chunks.2.params.0",
        "transformer.wpe.weight",
        "memory.chunks[2].params: parameter 'transformer.wpe.weight' is already in chunk 1",
    ),
    ("memory.chunks.1.id", 7, "memory.chunks[1].id: expected 1 (chunks are numbered in order), got 7"),
    (
        "memory.chunks.1.numel",
        70000,
        [
            "memory.chunks[1].numel: 70000 elements do not fit in memory.chunk_size 65536",
            "memory.chunks: hold 136496 elements, more than model.num_params 124672",
        ],
    ),
    ("memory.chunks.0.resident", "yes", "memory.chunks[0].resident: expected true or false, got 'yes'"),
    (
        "schema_version",
        9,
        "schema_version: unknown version 9 (this elixir-tune reads 1); upgrade elixir-tune or search the plan again",
    ),
    (
        "training.activation_checkpointing.every",
        -2,
        "training.activation_checkpointing.every: expected 0 (none), 1 (all) or k > 1, got -2",
    ),
    ("cluster.backend", "nccl", "cluster.backend: nccl needs GPUs; a cpu plan uses gloo"),
    (
        "memory.colour",
        "red",
        "memory.colour: unknown field (known: chunk_size, cache_blocks, prefetch, staging_buffers, chunks)",
    ),
    ("memory.staging_buffers", 0, "memory.staging_buffers: must be positive, got 0"),
    (
        "training.accumulation",
        "pipelined",
        "training.accumulation: unknown value 'pipelined' (expected one of standard, layered)",
    ),
    ("memory.staging_buffers", 1.5, "memory.staging_buffers: expected an integer, got 1.5"),
    ("cluster.device", _DELETE, "cluster.device: missing (expected one of cuda, cpu)"),
    ("memory.chunks.1.params.2", 7, "memory.chunks[1].params[2]: expected a string, got 7"),
    ("memory.chunks.0", "wte", "memory.chunks[0]: expected a mapping, got 'wte'"),
    ("training.activation_checkpointing", 2, "training.activation_checkpointing: expected a mapping, got 2"),
    (
        "training.activation_checkpointing.each",
        1,
        "training.activation_checkpointing.each: unknown field (known: every, mode)",
    ),
    (
        "training.activation_checkpointing.every",
        5,
        "training.activation_checkpointing.every: 5 is more than the model's 2 blocks, so no block would be "
        "checkpointed; set every to at most model.num_blocks, or 0 for none",
    ),
    ("memory.staging_buffers", float("nan"), "memory.staging_buffers: expected an integer, got nan"),
]


@pytest.mark.parametrize("field,value,expected", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_plan_gives_exact_problem(raw: dict, field: str, value, expected: str | list[str]):
    broken = copy.deepcopy(raw)
    _set(broken, field, value)
    assert validate_dict(broken) == (expected if isinstance(expected, list) else [expected])


def test_prediction_maps_are_checked_by_key_and_value(raw: dict):
    raw["prediction"] = {
        "step_time_s": 1.0,
        "tokens_per_s": 1.0,
        "tflops_per_gpu": 0.1,
        "mfu": 0.1,
        "peak_gpu_bytes": 1,
        "peak_host_bytes": 0,
        "model_state_bytes": {"cache_bytes": 1, "kv_bytes": 2},
        "breakdown": {"compute_s": "fast"},
    }
    assert validate_dict(raw) == [
        "prediction.model_state_bytes.kv_bytes: unknown key (known: cache_bytes, resident_bytes, "
        "device_shard_bytes, host_shard_bytes)",
        "prediction.breakdown.compute_s: expected a finite number, got 'fast'",
    ]
    raw["prediction"]["model_state_bytes"] = {}
    raw["prediction"]["breakdown"] = {"compute_s": float("nan")}
    raw["prediction"]["mfu"] = float("inf")
    assert validate_dict(raw) == [
        "prediction.mfu: expected a finite number, got inf",
        "prediction.breakdown.compute_s: expected a finite number, got nan",
    ]


def test_staging_buffers_default_and_round_trip(tmp_path: Path, raw: dict):
    assert "staging_buffers" not in raw["memory"]
    assert load_plan(EXAMPLE).memory.staging_buffers == 2
    raw["memory"]["staging_buffers"] = 3
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(raw))
    plan = load_plan(path)
    assert plan.memory.staging_buffers == 3
    save_plan(plan, path)
    assert read_plan_dict(path)["memory"]["staging_buffers"] == 3


def test_missing_section_and_top_level_type():
    assert validate_dict([1, 2]) == ["plan: expected a mapping at the top level, got list"]
    raw = read_plan_dict(EXAMPLE)
    del raw["memory"]
    assert validate_dict(raw) == ["memory: missing section"]


def test_every_problem_is_listed(tmp_path: Path, raw: dict):
    _set(raw, "cluster.device", "tpu")
    _set(raw, "memory.cache_blocks", 5)
    _set(raw, "model.num_params", 0)
    path = tmp_path / "three.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(PlanError) as caught:
        load_plan(path)
    assert len(caught.value.problems) == 3
    assert str(path) in str(caught.value)


def test_yaml_syntax_error_names_line_and_column(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("schema_version: 1\nmodel: {source: a, fingerprint: b\ncluster: [\n")
    with pytest.raises(PlanError) as caught:
        load_plan(path)
    (problem,) = caught.value.problems
    assert problem.startswith("YAML syntax error at line 3, column")


def test_missing_file_and_missing_env(tmp_path: Path, monkeypatch):
    with pytest.raises(PlanError, match="file not found"):
        load_plan(tmp_path / "nope.yaml")
    monkeypatch.delenv("ELIXIR_TUNE_PLAN", raising=False)
    with pytest.raises(PlanError, match="ELIXIR_TUNE_PLAN is not set"):
        load_plan()
    monkeypatch.setenv("ELIXIR_TUNE_PLAN", str(EXAMPLE))
    assert load_plan().model.name == "gpt2-tiny"


def test_validate_command_exit_status(tmp_path: Path, raw: dict):
    from click.testing import CliRunner

    from elixir_tune.cli.main import cli

    runner = CliRunner()
    ok = runner.invoke(cli, ["validate", str(EXAMPLE)])
    assert ok.exit_code == 0, ok.output
    _set(raw, "training.dtype", "fp8")
    _set(raw, "memory.chunk_size", 65535)
    _set(raw, "memory.chunks.1.params.0", "transformer.wte.weight")
    path = tmp_path / "three.yaml"
    path.write_text(yaml.safe_dump(raw))
    bad = runner.invoke(cli, ["validate", str(path), "--json"])
    assert bad.exit_code == 1
    report = yaml.safe_load(bad.output)
    assert report["valid"] is False
    assert [p.split(":")[0] for p in report["problems"]] == [
        "training.dtype",
        "memory.chunk_size",
        "memory.chunks[1].params",
    ]


def test_plan_package_imports_no_torch():
    code = "import sys, elixir_tune.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_frozen_version_1_fixture_keeps_loading():
    fixture = Path(__file__).parent / "plans" / "v1-gpt2-tiny.yaml"
    plan = load_plan(fixture)
    assert plan.schema_version == 1
    assert [len(chunk.params) for chunk in plan.memory.chunks] == [1, 13, 14]
    assert plan.training.activation_checkpointing.applies_to(0)
    assert plan.training.accumulation == "standard"  # written before the field existed
