"""What the CPU and CUDA probes share: constants, progress messages, notes, collective workers."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from elixir_tune.device import ops_for
from elixir_tune.hardware import host
from elixir_tune.hardware.bench_compute import block_rates
from elixir_tune.hardware.timing import MiB, asymptotic_gbps
from elixir_tune.hardware.workers import run_workers

Progress = Callable[[str], None] | None

DEFAULT_CPU_PROCS = 2
# NCCL over InfiniBand/RoCE reaches ~90% of the link; gloo/NCCL sockets over TCP much less.
_IB_EFFICIENCY, _ETHERNET_EFFICIENCY = 0.9, 0.6
_ASSUMED_ETHERNET_GBPS = 1.25  # 10 GbE when no link speed can be read


# Block shapes (batch, seq, hidden, heads) of the block-rate curve, small to large: a small model's
# blocks run far below the matmul rate (per-op overhead), a large one's near its model-level rate.
# On the CPU they span the demo's GPT-2 tiny (hidden 64) to GPT-2 small widths.
CPU_BLOCKS = [(8, 128, 64, 4), (4, 128, 256, 4), (4, 128, 512, 8), (2, 256, 768, 12)]
CUDA_BLOCKS = [(1, 1024, 1024, 16), (2, 1024, 2048, 16), (4, 1024, 4096, 32), (4, 2048, 6144, 48)]


OVERHEAD_NOTE = "measured: forward+backward of a tiny block (batch 1, seq 8, hidden 64): per-call overhead"
POINTWISE_NOTE = (
    "measured: forward+backward of a tanh-GELU written op by op, over the middle block shape's MLP activation; "
    "pointwise output bytes (elixir_tune.pointwise) / median time"
)
DROPOUT_ATTENTION_NOTE = (
    "measured: a causal scaled_dot_product_attention of (batch, heads, seq, head dim) {shape}, forward+backward "
    "with dropout 0.1 (the CPU's math path) less without (flash), median times, per score element, one process "
    "with {threads} thread(s)"
)
HANDOFF_NOTE = (
    "measured: 4 Python threads taking turns through conditions on one lock, a 64x64 matmul between turns, "
    "median per hand-over net of the matmuls"
)


class ProbeError(RuntimeError):
    """A measurement failed; the message says which and why."""


def say(progress: Progress, message: str) -> None:
    if progress is not None:
        progress(message)


def versions() -> str:
    return f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"


def inter_node_gbps(intra_gbps: float) -> tuple[float, str]:
    link_gbps, how = host.network_gbps()
    if "InfiniBand" in how:
        value, note = link_gbps * _IB_EFFICIENCY, f"{how} x {_IB_EFFICIENCY} (not measured)"
    elif link_gbps > 0:
        value, note = link_gbps * _ETHERNET_EFFICIENCY, f"{how} x {_ETHERNET_EFFICIENCY} (not measured)"
    else:
        value = _ASSUMED_ETHERNET_GBPS * _ETHERNET_EFFICIENCY
        note = f"assumed 10 GbE x {_ETHERNET_EFFICIENCY} ({how}; not measured)"
    return min(value, intra_gbps), "estimate: " + note + ", capped by the intra-node rate"


def _curve_summary(curve: dict[int, float]) -> str:
    sizes = sorted(curve)
    return f"{sizes[0] // MiB} MiB..{sizes[-1] // MiB} MiB"


def asymptotic_note(curve: dict[int, float]) -> str:
    largest = max(curve)
    top = [size for size in sorted(curve) if size * 16 >= largest]
    return f"median over {top[0] // MiB}..{largest // MiB} MiB of sizes {_curve_summary(curve)} (bandwidth_curves)"


def measure_block_curves(
    device: torch.device,
    dtypes: list[str],
    shapes: list[tuple[int, int, int, int]],
    budget_s: float,
    progress: Progress,
) -> tuple[dict[str, dict[int, float]], float, float]:
    """Block forward+backward rate over ``shapes`` for each dtype (``bench_compute.block_rates``).

    Returns:
        (dtype -> {block parameters: TFLOP/s}, per-call overhead seconds and pointwise GB/s of the
        first dtype).
    """
    curves: dict[str, dict[int, float]] = {}
    firsts: list[tuple[float, float]] = []
    for dtype_name in dtypes:
        say(progress, f"transformer block forward+backward {dtype_name}")
        try:
            curves[dtype_name], overhead_s, rate_gbps = block_rates(device, dtype_name, shapes, budget_s)
        except RuntimeError:  # a dtype this device cannot run a block in
            continue
        firsts.append((overhead_s, rate_gbps))
        ops_for(device).empty_cache()
    overhead_s, rate_gbps = firsts[0] if firsts else (0.0, 0.0)
    return curves, overhead_s, rate_gbps


def block_note(shapes: list[tuple[int, int, int, int]], how: str) -> str:
    sizes = ", ".join(f"{b}x{s}x{h}" for b, s, h, _ in shapes)
    return (
        f"measured: a GPT-2 block's forward+backward (batch x seq x hidden {sizes}), FLOPs from "
        f"torch.utils.flop_counter / (median time - block_call_overhead_s - its pointwise bytes / pointwise_gbps), keyed by the block's parameter count, {how}"
    )


def block_sources(curve_note: str, pointwise_how: str) -> dict[str, str]:
    """Where the block-rate fields of a probe come from (``sources`` entries)."""
    return {
        "block_tflops_curves": curve_note,
        "model_tflops": "measured: the block rate at the largest shape (block_tflops_curves)",
        "block_call_overhead_s": OVERHEAD_NOTE,
        "pointwise_gbps": POINTWISE_NOTE + pointwise_how,
    }


def run_collectives(
    device: str,
    procs: int,
    threads: int,
    coll_sizes: list[int],
    copy_sizes: list[int],
    adam_elements: int,
    budget_s: float,
    timeout_s: float,
    block_shapes: list[tuple[int, int, int, int]] | None = None,
    layout_repeats: int = 0,
) -> tuple[dict, float, float, str]:
    """Runs the multi-process benchmarks (collectives, concurrent copies, CPU Adam).

    Returns:
        (the workers' raw results, all-gather bus GB/s, reduce-scatter bus GB/s, a source note).
    """
    try:
        workers = run_workers(
            device,
            procs,
            threads,
            coll_sizes,
            copy_sizes,
            adam_elements,
            budget_s=budget_s,
            timeout_s=timeout_s,
            block_shapes=block_shapes,
            layout_repeats=layout_repeats,
        )
    except RuntimeError as error:
        raise ProbeError(str(error)) from None
    what = f"gloo, {procs} local processes" if device == "cpu" else f"NCCL, {procs} GPUs"
    note = f"measured: {what}, bus bandwidth (nccl-tests: algbw x (n-1)/n), {asymptotic_note(workers['allgather'])}"
    return workers, asymptotic_gbps(workers["allgather"]), asymptotic_gbps(workers["reduce_scatter"]), note


def host_adam_sources(alone: float, all_at_once: float, processes: int, impl: str, elements: int, how: str) -> dict:
    """The sources of the host Adam rates: one process alone (``cpu_adam_elems_per_s``) and all of a
    node's processes at once (``cpu_adam_node_elems_per_s``: their rates summed)."""
    return {
        "cpu_adam_elems_per_s": (
            f"measured: torch.optim.AdamW ({impl}) over {elements} fp32 host elements, one process alone, {how}"
        ),
        "cpu_adam_node_elems_per_s": (
            f"measured: the same in all {processes} processes at once, {all_at_once:.3g} elements/s each "
            f"(one alone: {alone:.3g}), summed"
        ),
    }
