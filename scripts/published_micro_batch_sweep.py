"""llm-foundry's own micro-batch sweep of MPT-7b and 13b against the cost model (issue 38).

mosaicml/llm-foundry scripts/train/benchmarking/larger_mb_1.md @ beb8dee6 ran MPT-7b and 13b at seq 2048
on 8 x A100 80GB, FULL_SHARD, MP Mode DEFAULT, no activation checkpointing, accumulation 2, and only the
micro-batch changing. Its time per micro-batch is linear in the micro-batch: a per-sample time plus a
fixed time per micro-batch. This fits both lines (the published one from the MFU column, the cost
model's from its pinned predictions, the peer's fp32 gathers included) and prints them side by side;
``published_overlap_fit.py`` sets the presets' ``collective_compute_loss`` from the fixed times.

    python scripts/published_micro_batch_sweep.py
"""

from __future__ import annotations

import dataclasses

from bench_published import best_plan, pinned_choices, profile_of
from published_setups import PUBLISHED

from elixir_tune.hardware import load_hardware
from elixir_tune.hardware.spec import HardwareSpec

SOURCE = "mosaicml/llm-foundry scripts/train/benchmarking/larger_mb_1.md @ beb8dee6922c5e31d27a24a713a1315b4013185d"
# (size, micro-batch, MFU %) rows of the source, all seq 2048, 8 GPUs, accumulation 2, no checkpointing.
SWEEP = {
    "7b": ((1, 46.59), (2, 55.97), (4, 62.46), (6, 65.25)),
    "13b": ((1, 49.18), (2, 58.67)),
}
PRESET = "a100-80gb-sxm"


@dataclasses.dataclass
class SweepLine:
    """One model's sweep: per-micro-batch seconds = micro x per-sample + fixed, published and predicted."""

    size: str
    rows: list[tuple[int, float, float]]  # (micro-batch, published MFU, predicted MFU)
    published: tuple[float, float]  # (per-sample s, fixed s)
    predicted: tuple[float, float]


def line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (per-sample, fixed) of per-micro-batch time = micro x per-sample + fixed."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return slope, mean_y - slope * mean_x


def sweep_lines(spec: HardwareSpec | None = None) -> list[SweepLine]:
    """Both models' sweep lines on ``spec`` (default: the A100 80GB preset), in seconds."""
    spec = spec or load_hardware(PRESET)
    out = []
    for size, rows in SWEEP.items():
        template = next(s for s in PUBLISHED if s.model == f"mpt-{size}" and s.hardware == PRESET)
        published, predicted, table = [], [], []
        unit_s = 0.0  # seconds of one sample's model FLOPs at the peak
        for micro, mfu in rows:
            setup = dataclasses.replace(
                template, gpus_per_node=8, nodes=1, seq_len=2048, micro_batch_size=micro, grad_accum_steps=2
            )
            setup = dataclasses.replace(setup, checkpointing="none")
            plan = best_plan(
                profile_of(setup), setup, pinned_choices(setup), lift_memory=True, hardware=spec, peer=True
            )
            unit_s = plan["step_time_s"] / 2 / (micro / plan["mfu"])
            published.append((micro, micro / (mfu / 100)))  # per micro-batch, in samples at the peak
            predicted.append((micro, micro / plan["mfu"]))
            table.append((micro, mfu / 100, plan["mfu"]))
        pub, pred = line(published), line(predicted)
        out.append(SweepLine(size, table, (pub[0] * unit_s, pub[1] * unit_s), (pred[0] * unit_s, pred[1] * unit_s)))
    return out


def main() -> None:
    print(f"Source: {SOURCE}\n")
    lines = sweep_lines()
    print("| size | micro-batch | published MFU | predicted MFU | ratio |")
    print("|---|---:|---:|---:|---:|")
    for sweep in lines:
        for micro, published, predicted in sweep.rows:
            print(f"| {sweep.size} | {micro} | {published:.3f} | {predicted:.3f} | {predicted / published:.2f} |")
    print("\nPer micro-batch = micro x per-sample + fixed, in seconds:\n")
    print("| size | published per-sample s | published fixed s | predicted per-sample s | predicted fixed s |")
    print("|---|---:|---:|---:|---:|")
    for sweep in lines:
        print(
            f"| {sweep.size} | {sweep.published[0]:.3f} | {sweep.published[1]:.3f} "
            f"| {sweep.predicted[0]:.3f} | {sweep.predicted[1]:.3f} |"
        )


if __name__ == "__main__":
    main()
