"""`probe()`: measure this machine and describe it as a HardwareSpec.

With GPUs, device 0 is measured alone (memory, matmul, HBM copy, pinned copies, GPU Adam), all
GPUs together for the concurrent copies, and one worker process per GPU for NCCL collectives and
CPU Adam with the cores one rank gets. Without GPUs the CPU is the device: ``procs`` worker
processes share the host, each with cores/procs threads, and gloo carries the collectives, so
that CI gets a real spec to plan with.
"""

from __future__ import annotations

import torch

from elixir_tune.device import cuda_available
from elixir_tune.hardware.presets import with_borrowed_constants
from elixir_tune.hardware.probe_common import DEFAULT_CPU_PROCS, ProbeError, Progress
from elixir_tune.hardware.probe_cpu import probe_cpu
from elixir_tune.hardware.probe_cuda import probe_cuda
from elixir_tune.hardware.spec import HardwareSpec

__all__ = ["DEFAULT_CPU_PROCS", "ProbeError", "probe"]


def probe(
    quick: bool = False, progress: Progress = None, procs: int | None = None, device: str | None = None
) -> HardwareSpec:
    """Measures the local machine.

    Args:
        quick: smaller sizes and fewer repeats (under ~30 s on a 2-core CPU machine).
        progress: called with a short description as each measurement starts.
        procs: worker processes when the CPU is the device (default 2); ignored with GPUs.
        device: "cuda" or "cpu" to force one; default cuda when available.

    Returns:
        A spec whose ``sources`` say how each number was measured.

    Raises:
        ProbeError: a measurement failed (e.g. the collective workers could not start).
    """
    if device is None:
        device = "cuda" if cuda_available() else "cpu"
    if device == "cuda" and not cuda_available():
        raise ProbeError("device cuda requested but torch.cuda.is_available() is False")
    threads_before = torch.get_num_threads()
    try:
        if device == "cuda":
            # What one machine's probe cannot measure comes from the closest preset, its source saying so.
            return with_borrowed_constants(probe_cuda(quick, progress))
        return probe_cpu(quick, progress, procs or DEFAULT_CPU_PROCS)
    finally:
        torch.set_num_threads(threads_before)
