"""A hardware description recalibrated from measured steps: every rate scaled by how far the cost model's
predictions were off on this machine.

The factor is the median over the measured plans of measured / predicted step time. Every rate of the
file (compute, memory, links, collectives, Adam) is divided by it and every fixed time (latencies,
per-call overheads) multiplied by it, so each prediction made with the new file is the old one times
the factor: the plans' order is kept, and their spread around the factor (``spread``) is what one
factor cannot fix. One factor for all rates, because a few short runs of whole steps cannot tell
compute from communication apart; ``elixir-tune probe`` measures each rate on its own. Imports no
torch.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from datetime import datetime, timezone

from elixir_tune.hardware.presets import POSITIVE_RATES
from elixir_tune.hardware.spec import HardwareSpec

# Rates (higher is faster): divided by the factor.
RATE_FIELDS = (*POSITIVE_RATES, "cpu_adam_node_elems_per_s", "pointwise_gbps")
RATE_DICT_FIELDS = ("matmul_tflops", "model_tflops", "attention_tflops")
# Fixed times (higher is slower): multiplied by the factor.
TIME_FIELDS = (
    "copy_latency_s",
    "collective_latency_s",
    "block_call_overhead_s",
    "thread_handoff_s",
    "dropout_attention_s_per_score",
    "tensor2_block_fixed_s",
    "pipeline_stage_microbatch_s",
)


def time_factor(ratios: list[float]) -> float:
    """The factor: the median of measured / predicted step times.

    Raises:
        ValueError: no ratio to calibrate from.
    """
    usable = [ratio for ratio in ratios if ratio and ratio > 0]
    if not usable:
        raise ValueError("no plan ran with a prediction: nothing to calibrate from")
    return statistics.median(usable)


def spread(ratios: list[float], factor: float) -> float:
    """How far the plans stay off after calibration: the largest of ratio / factor and its inverse
    (1.0 when one factor explains every plan)."""
    usable = [ratio / factor for ratio in ratios if ratio and ratio > 0]
    return max(max(r, 1 / r) for r in usable) if usable else 1.0


def calibrated(hardware: HardwareSpec, factor: float, note: str) -> HardwareSpec:
    """The hardware with every rate divided by ``factor`` and every fixed time multiplied by it.

    Args:
        hardware: the description the predictions used.
        factor: measured / predicted step time (``time_factor``).
        note: how it was measured (recorded in ``sources.calibrated``).

    Returns:
        A new description, named after the old one with ``-calibrated``.
    """
    if factor <= 0:
        raise ValueError(f"calibration factor {factor}: must be positive")
    changes: dict = {name: getattr(hardware, name) / factor for name in RATE_FIELDS}
    changes.update({name: getattr(hardware, name) * factor for name in TIME_FIELDS})
    for name in RATE_DICT_FIELDS:
        changes[name] = {dtype: rate / factor for dtype, rate in getattr(hardware, name).items()}
    changes["block_tflops_curves"] = {
        dtype: {size: rate / factor for size, rate in curve.items()}
        for dtype, curve in hardware.block_tflops_curves.items()
    }
    stamp = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}"
    sources = dict(hardware.sources)
    sources["calibrated"] = (
        f"{stamp}: every rate of '{hardware.name}' divided by {factor:.3g} and every fixed time multiplied by it, "
        f"the median measured / predicted step time of {note}"
    )
    name = hardware.name if hardware.name.endswith("-calibrated") else f"{hardware.name}-calibrated"
    return replace(hardware, name=name, sources=sources, **changes)
