"""`validate` and `elixir-run` compare a plan with the profile it was searched from (its
``search.profile``): hand edits that leave a parameter out, miscount a chunk, zero the blocks or
outrun the model's positions are refused before any worker starts, and every plan the search
writes (data, pipeline, tensor and expert layouts) agrees with its profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from elixir_tune.cli.main import cli
from elixir_tune.cli.run import run_command
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.profiler.plan_match import plan_profile_problems
from elixir_tune.profiler.schema import save_profile
from elixir_tune.search import search


@pytest.fixture
def searched(tmp_path: Path, monkeypatch) -> tuple[Path, dict]:
    """A synthetic 2-block GPT-2's profile (1,024 positions) and the plan searched from it."""
    monkeypatch.chdir(tmp_path)
    profile = gpt2_profile("tiny", hidden=64, layers=2, heads=4, vocab=256, seq_len=128, dtype="fp32")
    profile.max_seq_len = 1024
    profile_path = tmp_path / "profile.yaml"
    save_profile(profile, profile_path)
    result = CliRunner().invoke(
        cli, ["search", "--profile", str(profile_path), "--gpus", "2", "--hardware", "cpu", "--out", "plan.yaml"]
    )
    assert result.exit_code == 0, result.output
    return tmp_path, yaml.safe_load(Path("plan.yaml").read_text())


def _edited(raw: dict, edit) -> Path:
    edit(raw)
    path = Path("edited.yaml")
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _drop_last_param(raw: dict) -> None:
    raw["memory"]["chunks"][-1]["params"].pop()


EDITS = {
    "a parameter in no chunk": (_drop_last_param, "trainable parameter(s) in no chunk (transformer.ln_f.bias)"),
    "a chunk's numel": (
        lambda raw: raw["memory"]["chunks"][0].update(numel=raw["memory"]["chunks"][0]["numel"] + 8),
        "memory.chunks[0].numel",
    ),
    "seq_len past the positions": (
        lambda raw: raw["training"].update(seq_len=4096),
        "training.seq_len: 4096 tokens, but the model's position table holds 1024",
    ),
    "blocks": (lambda raw: raw["model"].update(num_blocks=3), "model.num_blocks: 3, but the model has 2 blocks"),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_validate_and_elixir_run_refuse_a_plan_its_profile_contradicts(searched, case):
    _, raw = searched
    edit, expected = EDITS[case]
    path = _edited(raw, edit)
    result = CliRunner().invoke(cli, ["validate", str(path), "--json"])
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert not report["valid"] and any(expected in problem for problem in report["problems"]), report
    # elixir-run makes the same check before it composes torchrun's command line.
    run = CliRunner().invoke(run_command, [str(path), "pretrain", "--synthetic", "--steps", "1"])
    assert run.exit_code == 1 and expected in run.output and "Traceback" not in run.output, run.output


def test_zero_blocks_with_a_block_list_is_refused_without_the_profile(searched):
    tmp_path, raw = searched
    (tmp_path / "profile.yaml").unlink()
    path = _edited(raw, lambda raw: raw["model"].update(num_blocks=0))
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 1 and "model.num_blocks: 0, but model.block_list names" in result.output


def test_the_searched_plan_is_valid_and_says_what_it_was_checked_against(searched, tmp_path):
    result = CliRunner().invoke(cli, ["validate", "plan.yaml"])
    assert result.exit_code == 0 and "checked against its profile" in result.output, result.output
    (tmp_path / "profile.yaml").unlink()
    result = CliRunner().invoke(cli, ["validate", "plan.yaml"])
    assert result.exit_code == 0 and "is gone, so the plan was checked alone" in result.output, result.output


LAYOUTS = {
    "data": ({}, "plain"),
    "pipeline 2": ({"pipeline": 2}, "forward_backward"),
    "tensor 2": ({"tensor": 2}, "forward_backward"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_the_search_writes_agrees_with_its_profile(layout):
    profile = gpt2_profile("tiny", hidden=64, layers=4, heads=4, vocab=256, seq_len=128, dtype="fp32")
    fixed, loop = LAYOUTS[layout]
    result = search(profile, load_hardware("cpu"), gpus_per_node=4, global_batch_size=8, fixed=fixed, loop=loop)
    raw = result.plan.to_dict()
    assert plan_profile_problems(raw, profile) == []


@pytest.mark.slow
def test_an_expert_parallel_plan_agrees_with_its_profile():
    from elixir_tune.profiler import profile_model
    from elixir_tune.profiler.source import quiet_transformers
    from tests.zoo.models import SEQ, model_source

    with quiet_transformers():
        profile = profile_model(model_source("qwen3_moe"), batch_size=2, seq_len=SEQ, checkpointing="all")
    result = search(profile, load_hardware("cpu"), gpus_per_node=2, global_batch_size=4, fixed={"expert": 2})
    raw = result.plan.to_dict()
    assert raw["parallel"]["expert"]["degree"] == 2
    assert plan_profile_problems(raw, profile) == []
