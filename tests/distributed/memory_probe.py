"""Measures the peak bytes a training step really allocates, without asking the engine.

CPU: the bytes of the tensor storages alive at the start of the step (every tensor the garbage
collector can see, each storage counted once) plus the peak of the cumulative allocation during
the step, from torch.profiler's memory events (allocations and frees in time order).
CUDA: ``torch.cuda.max_memory_allocated`` over the step, after resetting the peak.

What neither sees: memory a library allocates outside PyTorch's allocator or on threads the
profiler does not follow (gloo's internal gather buffers run on gloo's threads; NCCL's buffers);
the cost model keeps those in the margin it leaves free, not in the predicted peak.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def live_cpu_storage_bytes() -> int:
    """Bytes of the distinct CPU tensor storages alive now."""
    gc.collect()
    sizes: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
            continue
        if is_traceable_wrapper_subclass(obj):
            continue  # a wrapper (a DTensor): its inner tensors are counted themselves
        storage = obj.untyped_storage()
        address = storage.data_ptr()
        if address:
            sizes[address] = max(sizes.get(address, 0), storage.nbytes())
    return sum(sizes.values())


def peak_step_bytes(step: Callable[[], None], device: torch.device, warmup: Callable[[], None]) -> dict[str, int]:
    """Runs ``warmup`` then ``step`` and measures what ``step`` allocated.

    On the CPU the profiler records both: it cannot see the size of a block freed in the measured
    step that was allocated before it started (say a cache payload evicted and gathered again), so
    the warm-up, where such blocks come from, runs under it too; the peak is taken inside the
    measured step only, from the allocation level at its start.

    Returns:
        ``live_bytes`` at the start, ``step_peak_bytes`` (above the start) and ``peak_bytes``
        (their sum: the step's peak).
    """
    if device.type == "cuda":
        warmup()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {"live_bytes": start, "step_peak_bytes": peak - start, "peak_bytes": peak}
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        warmup()
        live = live_cpu_storage_bytes()
        with torch.profiler.record_function(_MARK):
            step()
    events = list(prof.profiler.kineto_results.events())
    mark = next(event for event in events if event.name() == _MARK)
    begin_ns, end_ns = mark.start_ns(), mark.start_ns() + mark.duration_ns()
    memory = sorted((event.start_ns(), event.nbytes()) for event in events if event.name() == "[memory]")
    start_level = sum(nbytes for time_ns, nbytes in memory if time_ns < begin_ns)
    level = peak = start_level
    for time_ns, nbytes in memory:
        if begin_ns <= time_ns <= end_ns:
            level += nbytes
            peak = max(peak, level)
    step_peak = peak - start_level
    return {"live_bytes": live, "step_peak_bytes": step_peak, "peak_bytes": live + step_peak}


_MARK = "memory_probe.measured_step"
