"""`elixir-tune search`: plan written and valid, table and JSON, clear errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from elixir_tune.cli.main import cli
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.plan import load_plan
from elixir_tune.profiler.schema import save_profile


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_profile(gpt2_profile("gpt2-4b"), tmp_path / "profile.yaml")
    save_profile(gpt2_profile("gpt2-20b"), tmp_path / "big.yaml")
    return tmp_path


def invoke(*args: str):
    return CliRunner().invoke(cli, ["search", *args])


def test_search_writes_a_valid_plan_and_shows_the_best_candidates(workdir):
    result = invoke("--gpus", "2", "--hardware", "a100-40gb-pcie", "--top", "3")
    assert result.exit_code == 0, result.output
    plan = load_plan(workdir / "plan.yaml")  # raises unless valid
    assert plan.prediction is not None and plan.cluster.world_size == 2
    for column in ("chunk MiB", "cache", "offloaded", "ckpt", "TFLOPS/GPU", "MFU", "GPU GiB", "host GiB"):
        assert column in result.output
    assert "why #1" in result.output
    text = (workdir / "plan.yaml").read_text()
    assert text.startswith("# Written by `elixir-tune search")
    assert "elixir-run plan.yaml pretrain" in text  # a recipe name: it works from any directory


def test_search_json_and_pins(workdir):
    result = invoke(
        "--gpus",
        "2",
        "--hardware",
        "a100-40gb-pcie",
        "--fix",
        "offload=0.5",
        "--fix",
        "cache_blocks=all",
        "--fix",
        "checkpointing=all",
        "--global-batch-size",
        "32",
        "--out",
        "p.yaml",
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["plan"] == "p.yaml" and data["candidates_scored"] >= 1
    best = data["candidates"][0]
    assert best["offload"] == pytest.approx(0.5, abs=0.05) and best["cache_blocks"] == best["cacheable_chunks"]
    assert best["checkpointing"] == 1
    plan = load_plan(workdir / "p.yaml")
    assert plan.training.global_batch_size == 32


def test_nothing_fits_exits_1_with_what_is_needed(workdir):
    result = invoke("--gpus", "1", "--profile", "big.yaml", "--hardware", "l4-24gb", "--host-memory", "32GiB")
    assert result.exit_code == 1
    assert "nothing fits" in result.output and "GiB" in result.output
    assert "hint" in result.output
    assert not (workdir / "plan.yaml").exists()


def test_bad_pin_exits_1_naming_the_key(workdir):
    result = invoke("--gpus", "2", "--hardware", "a100-40gb-pcie", "--fix", "cache=3")
    assert result.exit_code == 1
    assert "cache" in result.output and "known" in result.output


def test_no_hardware_tells_to_probe(workdir):
    result = invoke("--gpus", "2")
    assert result.exit_code == 1
    assert "elixir-tune probe" in result.output


def test_missing_profile_tells_to_profile(workdir):
    result = invoke("--gpus", "2", "--hardware", "a100-40gb-pcie", "--profile", "nope.yaml")
    assert result.exit_code == 1
    assert "elixir-tune profile" in result.output


def test_bad_host_memory_is_a_usage_error(workdir):
    result = invoke("--gpus", "2", "--hardware", "a100-40gb-pcie", "--host-memory", "lots")
    assert result.exit_code == 2


def test_host_memory_is_honoured_on_a_cpu_device(workdir):
    # On a CPU device the device's memory is the host's: 1 MiB holds no plan (before: a plan was written).
    save_profile(gpt2_profile("tiny", hidden=64, layers=2, heads=2, vocab=256, positions=32, seq_len=32), "tiny.yaml")
    result = invoke("--gpus", "2", "--profile", "tiny.yaml", "--hardware", "cpu", "--host-memory", "1MiB")
    assert result.exit_code == 1, result.output
    assert "nothing fits the host" in result.output and "host memory per node" in result.output
    assert not (workdir / "plan.yaml").exists()
    assert invoke("--gpus", "2", "--profile", "tiny.yaml", "--hardware", "cpu").exit_code == 0


def test_device_memory_caps_what_a_rank_may_fill(workdir):
    result = invoke("--gpus", "2", "--hardware", "a100-40gb-pcie", "--device-memory", "2GiB")
    assert result.exit_code == 1, result.output
    assert "nothing fits the device" in result.output and "device memory" in result.output
    roomy = invoke("--gpus", "2", "--hardware", "a100-40gb-pcie", "--device-memory", "30GiB", "--json")
    assert roomy.exit_code == 0, roomy.output
    assert json.loads(roomy.output)["prediction"]["peak_gpu_bytes"] <= 30 * 2**30
    assert invoke("--gpus", "2", "--hardware", "a100-40gb-pcie", "--device-memory", "lots").exit_code == 2


def test_a_pinned_offload_that_does_not_fit_names_the_device(workdir):
    # gpt2-20b on one 24 GB card with every shard kept on it: short of device memory, not host memory.
    result = invoke("--gpus", "1", "--profile", "big.yaml", "--hardware", "l4-24gb", "--fix", "offload=0")
    assert result.exit_code == 1
    assert "nothing fits the device" in result.output and "pinned offload share 0" in result.output
    assert "host memory per node" not in result.output


def test_the_plan_names_its_profile(workdir):
    assert invoke("--gpus", "2", "--hardware", "a100-40gb-pcie").exit_code == 0
    assert load_plan(workdir / "plan.yaml").search.profile == str(workdir / "profile.yaml")


def test_a_model_without_attention_gets_a_plan_and_a_plain_tensor_refusal(tmp_path, monkeypatch):
    """Mamba (no attention, no tensor plan in transformers): profiled from its Hugging Face directory,
    searched with everything else; a tensor pin is refused for the real cause."""
    from transformers import MambaConfig

    monkeypatch.chdir(tmp_path)
    MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2).save_pretrained("hf")
    profiled = CliRunner().invoke(cli, ["profile", "hf", "--batch-size", "2", "--seq-len", "8"])
    assert profiled.exit_code == 0, profiled.output
    result = invoke("--gpus", "2", "--hardware", "cpu", "--loop", "forward_backward")
    assert result.exit_code == 0, result.output
    plan = load_plan(tmp_path / "plan.yaml")
    assert plan.parallel.tensor.degree == 1 and plan.world_size == 2
    assert "tensor plan for the model's family" in plan.model.unsupported_layouts["tensor"]
    pinned = invoke("--gpus", "2", "--hardware", "cpu", "--loop", "forward_backward", "--fix", "tensor=2")
    assert pinned.exit_code != 0
    assert "model type 'mamba' ships no tensor plan" in pinned.output
    assert "tensor parallelism needs a tensor plan for the model's family" in pinned.output
    assert "head counts" not in pinned.output


def test_an_fsdp2_pin_on_a_three_block_qwen2_writes_a_valid_plan(tmp_path, monkeypatch):
    """Issue 48 saw 'the search produced an invalid plan: memory.prefetch: 1 must be smaller than
    memory.cache_blocks 1' here (it worked on a 6-block GPT-2)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen2.yaml").write_text(
        "architecture: qwen2\nseq_len: 64\nconfig: {hidden_size: 64, num_hidden_layers: 3, num_attention_heads: 4, "
        "num_key_value_heads: 2, intermediate_size: 128, vocab_size: 256, max_position_embeddings: 128}\n"
    )
    runner = CliRunner()
    assert runner.invoke(cli, ["profile", "qwen2.yaml", "--out", "p.yaml"]).exit_code == 0
    args = ["search", "--profile", "p.yaml", "--gpus", "2", "--hardware", "cpu", "--global-batch-size", "4"]
    result = runner.invoke(cli, [*args, "--fix", "dtype=fp32", "--fix", "engine=fsdp2", "--out", "plan.yaml"])
    assert result.exit_code == 0, result.output
    assert load_plan("plan.yaml").engine.name == "fsdp2"
    assert runner.invoke(cli, ["validate", "plan.yaml"]).exit_code == 0
