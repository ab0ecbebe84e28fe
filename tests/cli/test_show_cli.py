"""`elixir-tune show PLAN`: memory, timeline and placement of a searched plan and a hand-written one."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from elixir_tune import paths
from elixir_tune.cli.main import cli
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.plan import save_plan
from elixir_tune.search import search

EXAMPLE = str(paths.CONFIGS_DIR / "plans" / "example.yaml")


def test_show_a_searched_plan(tmp_path):
    plan = search(
        gpt2_profile("gpt2-10b"), load_hardware("a100-40gb-pcie"), gpus_per_node=1, loop="forward_backward"
    ).plan
    save_plan(plan, tmp_path / "plan.yaml")
    result = CliRunner().invoke(cli, ["show", str(tmp_path / "plan.yaml")])
    assert result.exit_code == 0, result.output
    for text in (
        "memory per device",
        "peak per GPU",
        "predicted step",
        "compute waiting for fetches",
        "chunk placement",
        "shard on host",
        "resident",
    ):
        assert text in result.output


def test_show_a_cpu_plan_counts_device_and_host_once_per_worker(tmp_path):
    plan = search(
        gpt2_profile("gpt2"), load_hardware("cpu"), gpus_per_node=2, fixed={"offload": 0.5}, loop="forward_backward"
    ).plan
    save_plan(plan, tmp_path / "plan.yaml")
    result = CliRunner(env={"COLUMNS": "200"}).invoke(cli, ["show", str(tmp_path / "plan.yaml")])
    assert result.exit_code == 0, result.output
    per_worker = plan.prediction.peak_gpu_bytes + plan.prediction.peak_host_bytes // 2
    assert "device and host are one memory" in result.output
    assert f"{per_worker:,}" in result.output


def test_show_json_of_a_searched_plan(tmp_path):
    plan = search(
        gpt2_profile("gpt2-4b"), load_hardware("a100-40gb-pcie"), gpus_per_node=2, loop="forward_backward"
    ).plan
    save_plan(plan, tmp_path / "plan.yaml")
    result = CliRunner().invoke(cli, ["show", str(tmp_path / "plan.yaml"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["prediction"]["step_time_s"] == plan.prediction.step_time_s
    assert data["memory"]["model_state_bytes"] == plan.prediction.model_state_bytes
    assert sum(run["count"] for run in data["placement"]) == len(plan.memory.chunks)


def test_show_the_hand_written_example_says_it_has_no_prediction():
    result = CliRunner().invoke(cli, ["show", EXAMPLE])
    assert result.exit_code == 0, result.output
    assert "no prediction" in result.output
    assert "chunk placement" in result.output
    data = json.loads(CliRunner().invoke(cli, ["show", EXAMPLE, "--json"]).output)
    assert data["prediction"] is None
    # cache 2 x 65536 fp32 elements, by the plan's formula
    assert data["memory"]["model_state_bytes"]["cache_bytes"] == 2 * 65536 * 4


def test_show_an_invalid_plan_exits_1(tmp_path):
    (tmp_path / "bad.yaml").write_text("schema_version: 1\nmodel: {}\n")
    result = CliRunner().invoke(cli, ["show", str(tmp_path / "bad.yaml")])
    assert result.exit_code == 1
    assert "validate" in result.output


@pytest.mark.parametrize(
    ("fixed", "texts"),
    [
        (["pipeline=2"], ("world 8 = data 4 x pipeline 2 x tensor 1", "micro-batches: bubble ")),
        (["pipeline=2", "micro_batch_size=1"], ("world 8 = data 4 x pipeline 2 x tensor 1", "pipeline step holds")),
        (["tensor=2", "pipeline=1"], ("world 8 = data 4 x pipeline 1 x tensor 2", "tensor-parallel collectives")),
        (
            ["pipeline=2", "tensor=2"],
            (
                "world 8 = data 2 x pipeline 2 x tensor 2",
                "tensor-parallel collectives",
                "micro-batches: bubble ",
                "tensor groups split each block's matrices (consecutive ranks, one node): [0,1] [2,3] [4,5] [6,7]",
                "pipeline groups pass activations stage to stage (one per data and tensor index): [0,2] [1,3] [4,6] [5,7]",
                "data groups shard the chunks and reduce gradients (one per stage and tensor index): [0,4] [1,5] [2,6] "
                "[3,7]",
            ),
        ),
    ],
)
def test_show_explains_a_pipeline_or_tensor_plan(tmp_path, fixed, texts):
    profile = gpt2_profile("p", hidden=256, layers=4, heads=4, vocab=1024, positions=128, seq_len=128)
    plan = search(profile, load_hardware("h100-80gb-sxm"), gpus_per_node=8, fixed=fixed, loop="forward_backward").plan
    save_plan(plan, tmp_path / "plan.yaml")
    result = CliRunner().invoke(cli, ["show", str(tmp_path / "plan.yaml")])
    assert result.exit_code == 0, result.output
    for text in texts:
        assert text in result.output
    data = json.loads(CliRunner().invoke(cli, ["show", str(tmp_path / "plan.yaml"), "--json"]).output)
    groups = data["parallel"]["groups"]
    assert sorted(rank for group in groups["tensor"] for rank in group) == list(range(8))
    assert [len(group) for group in groups["pipeline"]] == [plan.parallel.pipeline.stages] * (
        8 // plan.parallel.pipeline.stages
    )
    if plan.parallel.pipeline.stages > 1:
        accum = plan.training.grad_accum_steps
        assert data["parallel"]["virtual_stages_per_rank"] == 2  # 4 blocks, 2 stages, modular
        # (P-1)/(N v + P-1) with N >= P; with one micro-batch the 4 blocks run one after the other: half idle
        expected = 1 / (accum * 2 + 1) if accum >= 2 else 0.5
        assert data["parallel"]["bubble_fraction"] == round(expected, 4)
        formula = "(P-1)/(N v + P-1)" if accum >= 2 else "1 - N v / ((v-1) P + N + P-1)"
        assert f"bubble {formula} = {expected:.1%}" in result.output
        assert sum(data["parallel"]["chunks_per_stage"]) == len(plan.memory.chunks)
        # No-sync's held gradients get their own memory row when a step runs several micro-batches.
        assert ("gradients a pipeline step holds" in result.output) == (accum > 1)


def test_show_timeline_reads_the_profile_the_plan_names(tmp_path, monkeypatch):
    from elixir_tune.profiler.schema import save_profile

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save_profile(gpt2_profile("gpt2-4b"), tmp_path / "a" / "model.yaml")
    monkeypatch.chdir(tmp_path / "a")
    searched = CliRunner().invoke(
        cli, ["search", "--gpus", "2", "--hardware", "a100-40gb-pcie", "--profile", "model.yaml", "--out", "p.yaml"]
    )
    assert searched.exit_code == 0, searched.output
    monkeypatch.chdir(tmp_path / "b")  # no profile.yaml here
    plan_path = str(tmp_path / "a" / "p.yaml")
    result = CliRunner().invoke(cli, ["show", plan_path, "--timeline", "step.svg"])
    assert result.exit_code == 0, result.output
    assert "<svg" in (tmp_path / "b" / "step.svg").read_text()
    (tmp_path / "a" / "model.yaml").unlink()
    gone = CliRunner().invoke(cli, ["show", plan_path, "--timeline", "step.svg"])
    assert gone.exit_code == 1
    assert "model.yaml" in gone.output and "gone" in gone.output and "--profile" in gone.output


def test_show_of_a_pipeline_plan_reports_one_stage_consistently(tmp_path):
    # Every memory figure of the prediction is one stage's: its host shards are that stage's chunks.
    profile = gpt2_profile("p", hidden=256, layers=4, heads=4, vocab=1024, positions=128, seq_len=128)
    plan = search(
        profile,
        load_hardware("h100-80gb-sxm"),
        gpus_per_node=8,
        fixed=["pipeline=2", "offload=0.5"],
        loop="forward_backward",
    ).plan
    assert plan.prediction is not None
    states = plan.prediction.model_state_bytes
    shard_bytes = plan.memory.chunk_size // plan.data_parallel_size * 16
    per_stage = [sum(1 for c in plan.memory.chunks if c.stage == s and c.offload) for s in range(2)]
    assert states["host_shard_bytes"] in [count * shard_bytes for count in per_stage]
    held = plan.prediction.transient_bytes.get("held_grad_bytes", 0)
    device_states = states["cache_bytes"] + states["resident_bytes"] + states["device_shard_bytes"]
    assert plan.prediction.peak_gpu_bytes > device_states + held
    save_plan(plan, tmp_path / "plan.yaml")
    result = CliRunner().invoke(cli, ["show", str(tmp_path / "plan.yaml")])
    assert result.exit_code == 0, result.output
    assert "stage with the highest peak" in result.output and "(all stages)" in result.output
    # Each stage's own promise: its host shards are its offloaded chunks; the headline is the highest peak.
    stages = plan.prediction.stages
    assert [entry.model_state_bytes["host_shard_bytes"] for entry in stages] == [n * shard_bytes for n in per_stage]
    assert plan.prediction.peak_gpu_bytes == max(entry.peak_gpu_bytes for entry in stages)
    assert "memory per rank of each pipeline stage" in result.output


def test_show_explains_an_expert_plan(tmp_path):
    """The expert groups, what each rank holds, and the all-to-all bytes (from the profile the plan
    names) and share of the predicted step."""
    from elixir_tune.costmodel.expert import expert_all_to_all_bytes
    from elixir_tune.profiler import profile_model, save_profile
    from elixir_tune.profiler.source import quiet_transformers
    from elixir_tune.units import human_bytes
    from tests.zoo.models import SEQ, model_source

    with quiet_transformers():
        profile = profile_model(model_source("qwen3_moe"), batch_size=2, seq_len=SEQ)
    save_profile(profile, tmp_path / "profile.yaml")
    plan = search(
        profile,
        load_hardware("h100-80gb-sxm"),
        gpus_per_node=4,
        global_batch_size=16,
        fixed=["expert=2"],
        profile_path=str(tmp_path / "profile.yaml"),
    ).plan
    save_plan(plan, tmp_path / "plan.yaml")
    result = CliRunner().invoke(cli, ["show", str(tmp_path / "plan.yaml")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    sent = expert_all_to_all_bytes(2, plan.training.micro_batch_size * SEQ, 32, 2, 2, 4)
    assert "expert: degree 2, each rank holds 2 of the 4 experts of every block" in text
    assert f"{human_bytes(sent)} out of each rank" in text
    assert "expert groups hold different experts and exchange tokens (all-to-all): [0,1] [2,3]" in text
    assert "expert-data groups hold the same experts and reduce their gradients: [0,2] [1,3]" in text
    assert "expert-parallel all-to-alls (on the compute stream)" in text


def test_show_says_a_step_is_mostly_host_adam_and_how_it_moves_with_the_rate(tmp_path):
    """GPT-2 4B all offloaded on 8 x H100: host Adam is most of the step; the step at half and twice the rate
    is the search's own prediction on hardware with that rate (simulated again from the profile)."""
    import dataclasses

    from elixir_tune.costmodel.offload import host_adam_share
    from elixir_tune.profiler import save_profile

    profile, h100 = gpt2_profile("gpt2-4b"), load_hardware("h100-80gb-sxm")
    pins = {"offload": 1.0, "micro_batch_size": 4, "checkpointing": "all", "prefetch": 1}
    plan = search(profile, h100, gpus_per_node=8, fixed=pins, loop="forward_backward").plan
    assert host_adam_share(plan.prediction.breakdown, plan.prediction.step_time_s) > 0.3
    save_plan(plan, tmp_path / "plan.yaml")
    save_profile(profile, tmp_path / "profile.yaml")
    shown = CliRunner().invoke(cli, ["show", str(tmp_path / "plan.yaml"), "--profile", str(tmp_path / "profile.yaml")])
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())
    assert "mostly host Adam:" in text and "(1.8e+09 elements/s per node, h100-80gb-sxm:" in text
    pins.update(chunk_size=plan.memory.chunk_size, cache_blocks=plan.memory.cache_blocks)
    for factor in (0.5, 2.0):
        rate = dataclasses.replace(
            h100,
            cpu_adam_elems_per_s=h100.cpu_adam_elems_per_s * factor,
            cpu_adam_node_elems_per_s=h100.cpu_adam_node_elems_per_s * factor,
        )
        again = search(profile, rate, gpus_per_node=8, fixed=pins, loop="forward_backward").plan.prediction
        assert f"{again.step_time_s:.4g} s at {factor:g}x" in text, text
    assert "(simulated again)" in text
    # Without the profile: the optimizer alone moves, and it says so.
    alone = CliRunner().invoke(cli, ["show", str(tmp_path / "plan.yaml"), "--profile", str(tmp_path / "none.yaml")])
    assert "the optimizer alone moved" in " ".join(alone.output.split())
