"""`elixir-tune probe`: help, usage errors, and a real --quick run on this machine."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from elixir_tune.cli.main import cli
from elixir_tune.cli.probe import _table
from elixir_tune.hardware import load_hardware, spec_problems


def test_help_shows_options_and_example():
    result = CliRunner().invoke(cli, ["probe", "--help"])
    assert result.exit_code == 0
    for option in ("--quick", "--out", "--procs", "--json", "elixir-tune probe --quick"):
        assert option in result.output


def test_bad_procs_is_a_usage_error():
    result = CliRunner().invoke(cli, ["probe", "--procs", "0"])
    assert result.exit_code == 2


def test_table_puts_measured_next_to_preset():
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(_table(load_hardware("cpu"), "a100-40gb-pcie"))
    text = console.export_text()
    assert "closest preset: a100-40gb-pcie" in text and "all-gather busbw" in text
    assert "NVIDIA A100-PCIE-40GB" in text


# heavy: 85 s in CI (the load check and host Adam measured on top of the quick probe); CI keeps the
# probe's load refusal and recording (test_probe_load.py) and `scripts/test.sh --all` runs this.
@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.distributed
def test_quick_probe_writes_a_loadable_spec(tmp_path):
    # In this process (CliRunner): the probe's measurements run in its own worker processes either way, and
    # a fresh `elixir-tune` interpreter would only add its imports; tests/cli/test_help.py and
    # test_profile_cli.py start the console script itself.
    out = tmp_path / "sub" / "hardware.yaml"
    # --allow-loaded: CI machines are shared; the load is recorded either way (tests/cli/test_probe_load.py).
    result = CliRunner().invoke(cli, ["probe", "--quick", "--allow-loaded", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.stderr + repr(result.exception)
    report = json.loads(result.stdout)
    assert report["path"] == str(out)
    spec = load_hardware(str(out))
    scalars = {
        key: value
        for key, value in spec.to_dict().items()
        if key not in ("bandwidth_curves", "block_tflops_curves")  # JSON makes their keys strings
    }
    assert scalars == {key: report["hardware"][key] for key in scalars}  # the file holds what the run measured
    assert spec_problems(spec) == []
    assert {"loaded", "busy_cores_before", "steal_share", "load1_after"} <= set(spec.probe_load)
    if spec.device == "cpu":  # on a GPU machine tests/gpu/test_probe_gpu.py checks the CUDA fields
        assert spec.gpus_per_node == 2 and spec.gpu_memory_bytes * 2 <= spec.host_memory_bytes
        assert {"fp32", "bf16"} <= set(spec.matmul_tflops) and all(r > 0 for r in spec.matmul_tflops.values())
        assert spec.h2d_gbps == spec.d2h_gbps and spec.hbm_gbps > 0
        assert len(spec.block_tflops_curves["fp32"]) == 3 and spec.block_call_overhead_s > 0
        assert "all 2 processes at once" in spec.sources["block_tflops_curves"]
        assert spec.pointwise_gbps > 0 and spec.thread_handoff_s > 0
        # an attention with dropout runs the CPU's math path: slower than flash without it
        assert spec.dropout_attention_s_per_score > 0 and "math path" in spec.sources["dropout_attention_s_per_score"]
        # between compute a collective costs at least its back-to-back latency
        assert "right after a block forward+backward" in spec.sources["collective_latency_s"]
        assert spec.sources["allgather_gbps"].startswith("measured: gloo, 2 local processes")
        assert min(spec.bandwidth_curves["allgather_gbps"]) == 2**20
        # host Adam: one process alone, and the node's two at once summed (the device Adam: each of them)
        assert spec.cpu_adam_elems_per_s > 1e6 and spec.gpu_adam_elems_per_s > 1e6
        assert spec.cpu_adam_node_elems_per_s == pytest.approx(2 * spec.gpu_adam_elems_per_s)
        assert "one process alone" in spec.sources["cpu_adam_elems_per_s"]
        assert spec.sources["cpu_adam_node_elems_per_s"].startswith("measured: the same in all 2 processes")
        # the layout ratios at 2 processes (hardware/bench_layout.py); the fixed costs measured with the engine
        assert "bench_layout" in spec.sources["tensor2_block_extra_ratio"]
        for key in ("tensor2_block_fixed_s", "pipeline_stage_microbatch_s"):
            assert spec.sources[key].startswith("measured with the engine") and getattr(spec, key) >= 0
    assert spec.device == report["hardware"]["device"]
    assert spec.gpus_per_node == report["hardware"]["gpus_per_node"]
    assert report["closest_preset"] is not None
    header = out.read_text().splitlines()[0]
    assert header.startswith("# Measured by `elixir-tune probe --quick`")
    assert "--hardware" in out.read_text()
