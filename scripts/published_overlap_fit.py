"""Sets the presets' collective compute loss and recompute speed-up, and refits their block curves (issue 38).

llm-foundry's micro-batch sweep (``published_micro_batch_sweep.py``) shows a fixed time per micro-batch
(0.21 s for MPT-7b, 0.35 s for 13b on 8 x A100 80GB) that the model without it put at 0.02 s. It grows
with the parameters, not the tokens: the FSDP all-gathers and reduce-scatters every micro-batch runs.
``collective_compute_loss`` is the compute time lost per second of those collectives; this fits it so
the model's fixed times add up to the sweep's. The sweep's time per sample, against block rates fitted
to checkpointed rows, sets ``recompute_speedup`` (a recomputed forward is cheaper per FLOP than the
forward+backward mean). At each trial every block-curve point and the attention rate are refitted to the
README rows the presets name (``CURVE``, ``ATTENTION``), the peer's fp32 gathers included. Checkpointed
long-sequence rows (``CHECK``) are printed as a check the fit does not use. H100 takes A100's two values.

    python scripts/published_overlap_fit.py     # about 4 minutes; prints the values for the preset files
"""

from __future__ import annotations

import dataclasses
from functools import partial

from bench_published import best_plan, pinned_choices, profile_of
from published_micro_batch_sweep import sweep_lines
from published_setups import MPT, PUBLISHED

from elixir_tune.hardware import load_hardware
from elixir_tune.hardware.spec import HardwareSpec

# README rows of mosaicml/llm-foundry scripts/train/benchmarking/README.md @ 8c8dd48f each preset's
# curve comes from: (size, seq, micro-batch, accumulation, tokens/s per GPU, checkpointing).
CURVE = {
    "h100-80gb-sxm": (
        ("760m", 512, 96, 2, 83749, False),
        ("1b", 512, 56, 4, 52275, False),
        ("3b", 512, 40, 6, 27965, False),
        ("7b", 1024, 64, 2, 10203, True),
        ("13b", 1024, 40, 3, 5502, True),
        ("30b", 1024, 6, 21, 2084, True),
    ),
    "a100-80gb-sxm": (
        ("125m", 512, 128, 2, 165681, False),
        ("350m", 512, 128, 2, 69330, False),
        ("760m", 512, 96, 2, 29446, False),
        ("1b", 512, 56, 4, 23148, False),
        ("3b", 512, 40, 6, 12127, False),
        ("7b", 1024, 64, 2, 4357, True),
        ("13b", 1024, 40, 3, 2330, True),
        ("30b", 512, 12, 21, 967, True),
    ),
}
# Checkpointed long-sequence rows of the same tables, whose rates all come from uncheckpointed rows: a check
# the fit does not use (how a recomputed forward is priced shows on them).
CHECK = {
    "h100-80gb-sxm": (
        ("3b", 65536, 1, 2, 3262, True),
        ("3b", 32768, 3, 6, 5873, True),
        ("1b", 65536, 1, 2, 5506, True),
    ),
    "a100-80gb-sxm": (
        ("3b", 65536, 1, 2, 1767, True),
        ("3b", 32768, 3, 6, 3029, True),
        ("1b", 65536, 1, 2, 3044, True),
        ("760m", 65536, 1, 2, 4143, True),
    ),
}
ATTENTION = {
    "h100-80gb-sxm": ("760m", 32768, 1, 2, 16291, False),
    "a100-80gb-sxm": ("760m", 32768, 1, 2, 8802, False),
}


def ratio(spec: HardwareSpec, row: tuple) -> float:
    """Predicted over published tokens/s per GPU of one README row on 8 GPUs of ``spec``."""
    size, seq, micro, accum, published, checkpointed = row
    template = next(s for s in PUBLISHED if s.model == "mpt-7b" and s.gather_width == 2.0)
    hidden, layers, heads = MPT[size]
    setup = dataclasses.replace(
        template,
        model=f"mpt-{size}",
        gpt=(hidden, layers, heads, *template.gpt[3:]),
        hardware=spec.name,
        gpus_per_node=8,
        nodes=1,
        seq_len=seq,
        micro_batch_size=micro,
        grad_accum_steps=accum,
        checkpointing="all" if checkpointed else "none",
    )
    plan = best_plan(profile_of(setup), setup, pinned_choices(setup), lift_memory=True, hardware=spec, peer=True)
    return plan["tokens_per_s_per_gpu"] / published


def bisect(trial, low: float, high: float, rising: bool = True, steps: int = 18) -> float:
    """The x in [low, high] where ``trial(x)`` crosses 0 (``rising``: it grows with x)."""
    for _ in range(steps):
        mid = (low + high) / 2
        if (trial(mid) > 0) == rising:
            high = mid
        else:
            low = mid
    return (low + high) / 2


def with_point(spec: HardwareSpec, numel: int, tflops: float) -> HardwareSpec:
    """``spec`` with one block-curve point set (every dtype with a curve)."""
    curves = {dtype: {**curve, numel: tflops} for dtype, curve in spec.block_tflops_curves.items()}
    return dataclasses.replace(spec, block_tflops_curves=curves)


def with_attention(spec: HardwareSpec, tflops: float) -> HardwareSpec:
    """``spec`` with its attention rate set (every dtype with one)."""
    return dataclasses.replace(spec, attention_tflops={dtype: tflops for dtype in spec.attention_tflops})


def refit(spec: HardwareSpec) -> HardwareSpec:
    """``spec`` with each curve point and the attention rate set so their rows are predicted exactly."""
    for _ in range(2):  # the attention row reads the 760m point; the points read the attention rate a little
        for row in CURVE[spec.name]:
            spec = refit_point(spec, row)
        current = spec.attention_tflops["bf16"]
        row = ATTENTION[spec.name]
        rate = bisect(partial(_attention_gap, spec, row), current * 0.5, current * 2)
        spec = with_attention(spec, rate)
    return spec


def refit_point(spec: HardwareSpec, row: tuple) -> HardwareSpec:
    """``spec`` with the curve point of ``row``'s width set so the row is predicted exactly."""
    numel = 12 * MPT[row[0]][0] ** 2
    current = spec.block_tflops_curves["bf16"][numel]
    return with_point(spec, numel, bisect(partial(_point_gap, spec, numel, row), current * 0.5, current * 2))


def _point_gap(spec: HardwareSpec, numel: int, row: tuple, tflops: float) -> float:
    return ratio(with_point(spec, numel, tflops), row) - 1


def _attention_gap(spec: HardwareSpec, row: tuple, tflops: float) -> float:
    return ratio(with_attention(spec, tflops), row) - 1


def fit_loss(spec: HardwareSpec) -> float:
    """The loss at which the model's sweep fixed times add up to the published ones."""

    def gap(loss: float) -> float:
        lines = sweep_lines(dataclasses.replace(spec, collective_compute_loss=loss))
        return sum(s.predicted[1] - s.published[1] for s in lines)

    return bisect(gap, 0.0, 2.0, steps=14)


def fit_speedup(spec: HardwareSpec) -> HardwareSpec:
    """``spec`` refitted at the recompute speed-up where the sweep's per-sample times add up to the published."""

    def gap(speedup: float) -> float:
        trial = refit(dataclasses.replace(spec, recompute_speedup=speedup))
        return sum(s.published[0] - s.predicted[0] for s in sweep_lines(trial))

    return refit(dataclasses.replace(spec, recompute_speedup=bisect(gap, 1.0, 2.5, rising=False, steps=8)))


def main() -> None:
    a100 = load_hardware("a100-80gb-sxm")
    loss = 0.0
    for _ in range(2):  # the loss hardly moves the curve, nor the curve the fixed times
        loss = fit_loss(a100)
        a100 = fit_speedup(dataclasses.replace(a100, collective_compute_loss=loss))
    print(f"collective_compute_loss: {loss:.3f}, recompute_speedup {a100.recompute_speedup:.3f} (a100-80gb-sxm sweep)")
    for sweep in sweep_lines(a100):
        print(
            f"  {sweep.size}: fixed s published {sweep.published[1]:.3f} predicted {sweep.predicted[1]:.3f}; "
            f"per-sample s published {sweep.published[0]:.3f} predicted {sweep.predicted[0]:.3f}"
        )
    h100 = refit(
        dataclasses.replace(
            load_hardware("h100-80gb-sxm"), collective_compute_loss=loss, recompute_speedup=a100.recompute_speedup
        )
    )
    for spec in (a100, h100):
        print(f"{spec.name}: attention_tflops {spec.attention_tflops['bf16']:.1f}")
        for row in CHECK[spec.name]:
            print(f"  not fitted, checkpointed {row[0]} s{row[1]}: ratio {ratio(spec, row):.3f}")
        for row in CURVE[spec.name]:
            numel = 12 * MPT[row[0]][0] ** 2
            before = load_hardware(spec.name).block_tflops_curves["bf16"][numel]
            print(f"  {numel}: {spec.block_tflops_curves['bf16'][numel]:.1f}  # {row[0]} {row[1]} (was {before})")


if __name__ == "__main__":
    main()
