"""Host<->device copy bandwidth over transfer sizes: one device alone, and all devices at once.

On a CPU-only machine the "device" is host memory too, so a host->device copy is a copy between
two host buffers (what the engine does when a shard moves between "host" and "device").
Bandwidth here counts the bytes transferred once (the bandwidthTest host<->device convention).
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from elixir_tune.device import ops_for, pinned_host
from elixir_tune.hardware.timing import median_time_s


def _pinned(num_bytes: int) -> torch.Tensor:
    """A page-locked host buffer (allocated pinned, not pinned by a copy)."""
    return pinned_host(num_bytes).fill_(1)


def host_copy_curve(sizes_bytes: list[int], budget_s: float) -> dict[int, float]:
    """GB/s of a copy between two host buffers, per size (the CPU-as-device h2d/d2h)."""
    curve = {}
    for size in sizes_bytes:
        src = torch.ones(size, dtype=torch.uint8)
        dst = torch.empty_like(src)
        seconds = median_time_s(
            functools.partial(dst.copy_, src), torch.device("cpu"), budget_s / len(sizes_bytes), warmup=1
        )
        curve[size] = size / seconds / 1e9
        del src, dst
    return curve


def pinned_copy_curves(
    device_index: int, sizes_bytes: list[int], budget_s: float
) -> tuple[dict[int, float], dict[int, float]]:
    """Pinned host->GPU and GPU->host GB/s per size, one GPU copying alone.

    Returns:
        (h2d curve, d2h curve), each {bytes: GB/s}.
    """
    device = torch.device("cuda", device_index)
    host = _pinned(max(sizes_bytes))
    gpu = torch.empty(max(sizes_bytes), dtype=torch.uint8, device=device)
    h2d, d2h = {}, {}
    per_size_s = budget_s / (2 * len(sizes_bytes))
    with ops_for(device).device_scope():
        for size in sizes_bytes:
            src_host, dst_gpu = host[:size], gpu[:size]
            seconds = median_time_s(
                functools.partial(dst_gpu.copy_, src_host, non_blocking=True), device, per_size_s, warmup=2
            )
            h2d[size] = size / seconds / 1e9
            seconds = median_time_s(
                functools.partial(src_host.copy_, dst_gpu, non_blocking=True), device, per_size_s, warmup=2
            )
            d2h[size] = size / seconds / 1e9
    del host, gpu
    return h2d, d2h


def pinned_copy_curves_all(
    num_devices: int, sizes_bytes: list[int], budget_s: float
) -> tuple[dict[int, float], dict[int, float]]:
    """Per-GPU pinned copy GB/s per size when every GPU of the node copies at the same time.

    Each GPU gets its own pinned buffer and stream; the copies are queued on all of them and
    the wall time until the last one finishes gives the per-GPU rate (size / wall time).

    Returns:
        (h2d curve, d2h curve), each {bytes: GB/s per GPU}.
    """
    devices = [torch.device("cuda", index) for index in range(num_devices)]
    hosts = [_pinned(max(sizes_bytes)) for _ in devices]
    gpus = [torch.empty(max(sizes_bytes), dtype=torch.uint8, device=device) for device in devices]
    all_ops = [ops_for(device) for device in devices]
    streams = [ops.new_stream() for ops in all_ops]

    def run_all(size: int, to_gpu: bool) -> float:
        for ops in all_ops:
            ops.synchronize()
        begin = time.perf_counter()
        for ops, host, gpu, stream in zip(all_ops, hosts, gpus, streams, strict=True):
            with ops.use_stream(stream):
                if to_gpu:
                    gpu[:size].copy_(host[:size], non_blocking=True)
                else:
                    host[:size].copy_(gpu[:size], non_blocking=True)
        for ops, stream in zip(all_ops, streams, strict=True):
            ops.sync_stream(stream)
        return time.perf_counter() - begin

    h2d: dict[int, float] = {}
    d2h: dict[int, float] = {}
    for size in sizes_bytes:
        for to_gpu, curve in ((True, h2d), (False, d2h)):
            run_all(size, to_gpu)  # warm-up
            first_s = run_all(size, to_gpu)
            repeats = int(min(20, max(3, budget_s / (2 * len(sizes_bytes)) / first_s)))
            samples = [first_s] + [run_all(size, to_gpu) for _ in range(repeats - 1)]
            curve[size] = size / statistics.median(samples) / 1e9
    return h2d, d2h  # the buffers go with run_all's closure


def host_copy_latency_s(budget_s: float) -> float:
    """Time of one 4 KiB copy between host buffers: the fixed cost of a transfer on the CPU."""
    src = torch.ones(4096, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return median_time_s(functools.partial(dst.copy_, src), torch.device("cpu"), budget_s, max_repeats=1000)


def pinned_copy_latency_s(device_index: int, budget_s: float) -> float:
    """Time of one pinned 4 KiB host->GPU copy: the fixed cost of a transfer."""
    device = torch.device("cuda", device_index)
    host = _pinned(4096)
    gpu = torch.empty(4096, dtype=torch.uint8, device=device)
    with ops_for(device).device_scope():
        return median_time_s(lambda: gpu.copy_(host, non_blocking=True), device, budget_s, max_repeats=1000)
