"""The probe on this (CPU-only) machine, and the helpers it is built from."""

from __future__ import annotations

import time

import pytest
import torch

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
@pytest.mark.distributed
def test_failed_worker_is_reported_not_hung():
    # Asking the workers for NCCL on a machine without GPUs makes them fail at once.
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    begin = time.perf_counter()
    with pytest.raises(RuntimeError, match="probe worker"):
        run_workers("cuda", 2, 1, [MiB], [], 1024, budget_s=0.1, timeout_s=60)
    assert time.perf_counter() - begin < 60


def test_host_facts_are_read_from_the_os():
    import platform
    import re
    from pathlib import Path

    from elixir_tune.hardware import host

    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.is_file() else ""
    named = re.findall(r"^(?:model name|hardware|cpu model)\s*:\s*(.*?)\s*$", text, re.MULTILINE | re.IGNORECASE)
    if named:  # Linux: the first CPU's model line, read here independently
        assert host.cpu_name() == named[0]
    else:
        assert host.cpu_name() == (platform.processor() or platform.machine() or "unknown CPU")
    assert 1 <= host.host_cores() <= (__import__("os").cpu_count() or 1)
    assert 0 < host.host_available_bytes() <= host.host_memory_bytes()
    link_gbps, how = host.network_gbps()
    assert link_gbps >= 0 and how
