"""Timing helpers for the probe's micro-benchmarks: warm-up, adaptive repeats, median.

On CUDA a benchmark is timed with CUDA events on the current stream (what the GPU spent, not
the launch overhead of Python); on the CPU with perf_counter. Repeats adapt to a time budget so
that a slow device (a laptop CPU doing bf16) does not blow up `--quick`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from elixir_tune.device import ops_for

MiB = 2**20
GiB = 2**30


def synchronize(device: torch.device) -> None:
    """Waits for all work queued on ``device`` (no-op on the CPU)."""
    ops_for(device).synchronize()


def _time_once(fn: Callable[[], object], device: torch.device) -> float:
    return ops_for(device).time_s(fn)


def median_time_s(
    fn: Callable[[], object],
    device: torch.device,
    budget_s: float,
    min_repeats: int = 3,
    max_repeats: int = 50,
    warmup: int = 1,
) -> float:
    """Median wall time of ``fn`` on ``device``, repeated as often as ``budget_s`` allows.

    Args:
        fn: the operation; it must queue its work on the current stream of ``device``.
        device: where ``fn`` runs (cuda: timed with events; cpu: perf_counter).
        budget_s: rough time to spend on the timed repeats.
        min_repeats: repeats even when one run exceeds the budget.
        max_repeats: repeats at most, however fast ``fn`` is.
        warmup: untimed runs first (allocations, kernel selection, lazy loading).

    Returns:
        The median of the timed runs, in seconds.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    first_s = _time_once(fn, device)
    repeats = int(min(max_repeats, max(min_repeats, budget_s / max(first_s, 1e-7))))
    samples = [first_s] + [_time_once(fn, device) for _ in range(repeats - 1)]
    return statistics.median(samples)


def median_paired_extra_s(base_s: list[float], with_extra_s: list[float]) -> float:
    """What an extra piece of work adds, from runs taken in pairs (the base alone, then base and extra).

    The median of each pair's difference, not the difference of the two medians: the two runs of a pair
    are moments apart, so a change in the machine's load between pairs cancels out of every difference
    (with the difference of medians it does not, and on a shared machine it decided the result).

    Args:
        base_s: the base alone, one time per pair.
        with_extra_s: the base and the extra, the same pairs in the same order.

    Returns:
        Seconds, never below 0.

    Raises:
        ValueError: no pairs, or the two lists differ in length.
    """
    if not base_s or len(base_s) != len(with_extra_s):
        raise ValueError(f"need the same number (> 0) of both runs, got {len(base_s)} and {len(with_extra_s)}")
    return max(0.0, statistics.median(extra - base for base, extra in zip(base_s, with_extra_s, strict=True)))


def quartiles_note(values_s: list[float], unit_s: float = 1e-3, unit: str = "ms") -> str:
    """``"median M (quartiles Q1-Q3) ms of N"``: a measurement's centre and spread for a spec's ``sources``."""
    if len(values_s) < 2:
        return f"{values_s[0] / unit_s:.3g} {unit} of 1" if values_s else "no samples"
    q1, median, q3 = statistics.quantiles(values_s, n=4, method="inclusive")
    return f"median {median / unit_s:.3g} (quartiles {q1 / unit_s:.3g}-{q3 / unit_s:.3g}) {unit} of {len(values_s)}"


def asymptotic_gbps(curve: dict[int, float]) -> float:
    """The large-transfer rate of a {bytes: GB/s} curve.

    Median over the sizes of at least 1/16 of the largest: latency no longer matters there, and
    one noisy point (a shared machine) does not decide the result.
    """
    largest = max(curve)
    return statistics.median(gbps for size, gbps in curve.items() if size * 16 >= largest)


def size_ladder(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """Sizes min, min*factor, ... up to max (max always included)."""
    sizes, size = [], min_bytes
    while size < max_bytes:
        sizes.append(size)
        size *= factor
    sizes.append(max_bytes)
    return sizes
