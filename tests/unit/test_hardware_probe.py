"""The probe on this (CPU-only) machine, and the helpers it is built from."""

from __future__ import annotations

import time

import pytest
import torch

from elixir_tune.hardware import load_hardware, probe, save_hardware, spec_problems
from elixir_tune.hardware.timing import MiB, asymptotic_gbps, median_time_s, size_ladder
from elixir_tune.hardware.workers import run_workers


def test_size_ladder_spans_the_range():
    assert size_ladder(MiB, 64 * MiB) == [MiB, 4 * MiB, 16 * MiB, 64 * MiB]
    assert size_ladder(MiB, 1024 * MiB)[-1] == 1024 * MiB
    assert size_ladder(MiB, 48 * MiB) == [MiB, 4 * MiB, 16 * MiB, 48 * MiB]


def test_asymptotic_rate_ignores_small_sizes_and_one_outlier():
    curve = {MiB: 1.0, 4 * MiB: 2.0, 16 * MiB: 9.0, 64 * MiB: 10.0, 256 * MiB: 0.5}
    assert asymptotic_gbps(curve) == 9.0  # median of 16, 64, 256 MiB


def test_median_time_grows_with_work():
    small = median_time_s(lambda: torch.ones(2**10).sum(), torch.device("cpu"), 0.05)
    large = median_time_s(lambda: torch.ones(2**22).sum(), torch.device("cpu"), 0.05)
    assert 0 < small < large


@pytest.mark.slow
def test_quick_probe_describes_this_cpu_machine(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("covered by tests/gpu/test_probe_gpu.py on a GPU machine")
    messages = []
    begin = time.perf_counter()
    spec = probe(quick=True, progress=messages.append)
    elapsed_s = time.perf_counter() - begin
    assert elapsed_s < 60, "--quick is meant to finish in about 30 s on 2 cores"
    assert spec_problems(spec) == []
    assert spec.device == "cpu" and spec.gpus_per_node == 2
    assert spec.device_name and spec.host_cores >= 1
    assert spec.gpu_memory_bytes * 2 <= spec.host_memory_bytes
    assert {"fp32", "bf16"} <= set(spec.matmul_tflops)
    assert all(rate > 0 for rate in spec.matmul_tflops.values())
    assert spec.h2d_gbps == spec.d2h_gbps and spec.hbm_gbps > 0
    assert spec.sources["allgather_gbps"].startswith("measured: gloo, 2 local processes")
    assert set(spec.bandwidth_curves) >= {"h2d_gbps", "h2d_gbps_all", "allgather_gbps",
                                          "reduce_scatter_gbps"}
    assert min(spec.bandwidth_curves["allgather_gbps"]) == MiB
    assert spec.cpu_adam_elems_per_s == spec.gpu_adam_elems_per_s > 1e6
    assert any("gloo" in message for message in messages)
    path = tmp_path / "hardware.yaml"
    save_hardware(spec, path, header="probe test")
    assert load_hardware(str(path)) == spec


def test_failed_worker_is_reported_not_hung():
    # Asking the workers for NCCL on a machine without GPUs makes them fail at once.
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    begin = time.perf_counter()
    with pytest.raises(RuntimeError, match="probe worker"):
        run_workers("cuda", 2, 1, [MiB], [], 1024, budget_s=0.1, timeout_s=60)
    assert time.perf_counter() - begin < 60


def test_host_facts_are_read_from_the_os():
    from elixir_tune.hardware import host

    assert host.cpu_name()
    assert 1 <= host.host_cores() <= (__import__("os").cpu_count() or 1)
    assert 0 < host.host_available_bytes() <= host.host_memory_bytes()
    link_gbps, how = host.network_gbps()
    assert link_gbps >= 0 and how
