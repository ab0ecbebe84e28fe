#!/usr/bin/env python
"""Which measured hardware figures move the CPU layouts' predictions, and how far probe-to-probe noise moves them.

    .venv/bin/python scripts/bench_prediction_sensitivity.py hw1.yaml [hw2.yaml ...] [--step 0.1]
    .venv/bin/python scripts/bench_prediction_sensitivity.py benchmarks/results/prediction-cpu-layouts.json

A bench result (.json) stands for the spec its run predicted with: the ``cpu`` preset with every figure the
run recorded (``hardware`` in the JSON: all the CPU cost model reads) put in; its predictions are printed
beside the run's own as a check of that.

For the model of ``scripts/bench_prediction.py --layouts`` (its defaults: GPT-2 n_embd 256, 4 layers, seq 64,
global batch 16 on 2 workers) and each spec file (written by ``elixir-tune probe``), prints the predicted
step of the search's best data-only, pipeline 2 and tensor 2 plans. Then, on the first spec, scales each
scalar figure the cost model reads by (1 + step) and prints each layout's relative change divided by the
step (the elasticity: 1.0 means the prediction moves as much as the figure). A figure whose probe-to-probe
spread times its elasticity is large is one whose measurement must be steadier for the predicted order of
the layouts to hold. Measures nothing; only the cost model runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_prediction import MODEL_YAML  # noqa: E402
from bench_prediction_shapes import GLOBAL_BATCH, WORLD, layout_shapes  # noqa: E402

# Scalar figures the CPU cost model reads (hardware/spec.py); the curves are scaled through their owner.
FIGURES = (
    "collective_latency_s",
    "allgather_gbps",
    "reduce_scatter_gbps",
    "cpu_adam_elems_per_s",
    "block_call_overhead_s",
    "pointwise_gbps",
    "thread_handoff_s",
    "tensor2_block_extra_ratio",
    "tensor2_block_fixed_s",
    "pipeline_microbatch_extra_ratio",
    "pipeline_stage_microbatch_s",
    "block_tflops_curves",
)


def scaled(spec, figure: str, factor: float):
    """``spec`` with one figure multiplied by ``factor`` (a curve: every point; a rate with a
    ``bandwidth_curves`` entry: that curve too, as the cost model may read either)."""
    if figure == "block_tflops_curves":
        curves = {dtype: {n: r * factor for n, r in c.items()} for dtype, c in spec.block_tflops_curves.items()}
        return dataclasses.replace(
            spec, block_tflops_curves=curves, model_tflops={k: v * factor for k, v in spec.model_tflops.items()}
        )
    changes = {figure: getattr(spec, figure) * factor}
    if figure in spec.bandwidth_curves:
        curves = dict(spec.bandwidth_curves)
        curves[figure] = {size: rate * factor for size, rate in spec.bandwidth_curves[figure].items()}
        changes["bandwidth_curves"] = curves
    if figure == "cpu_adam_elems_per_s":
        changes["gpu_adam_elems_per_s"] = spec.gpu_adam_elems_per_s * factor
        if spec.cpu_adam_node_elems_per_s:
            changes["cpu_adam_node_elems_per_s"] = spec.cpu_adam_node_elems_per_s * factor
    return dataclasses.replace(spec, **changes)


def spec_of(path: str):
    """The spec a spec file holds, or the one a bench result's run predicted with (module docstring)."""
    from elixir_tune.hardware import load_hardware

    if not path.endswith(".json"):
        return load_hardware(path), None
    record = json.loads(Path(path).read_text())
    fields = {k: v for k, v in record["hardware"].items() if k != "name"}
    for key in ("block_tflops_curves",):  # JSON keys are strings
        fields[key] = {dtype: {int(n): r for n, r in c.items()} for dtype, c in fields[key].items()}
    spec = dataclasses.replace(
        load_hardware("cpu"),
        name=f"{record['hardware']['name']} (from {Path(path).name})",
        d2h_gbps=fields["h2d_gbps"],
        d2h_gbps_all=fields["h2d_gbps_all"],
        cpu_adam_node_elems_per_s=fields["cpu_adam_elems_per_s"] * record["world_size"],
        **fields,
    )
    return spec, {row["name"]: row["predicted_step_time_s"] for row in record["shapes"]}


def predictions_s(profile, spec) -> dict[str, float]:
    """Layout name -> the predicted step of the search's best plan of that layout on ``spec``."""
    return {name: result.plan.prediction.step_time_s for name, _pins, result in layout_shapes(profile, spec)}


def bench_profile():
    """The profile ``bench_prediction.py --layouts`` predicts with (its default model)."""
    from elixir_tune.profiler import load_model_source, profile_model

    with tempfile.TemporaryDirectory(prefix="sensitivity-") as tmp:
        path = Path(tmp) / "gpt2-bench.yaml"
        path.write_text(MODEL_YAML.format(name="gpt2-bench-256x4", hidden=256, layers=4, heads=4, vocab=256, seq=64))
        return profile_model(load_model_source(str(path)), batch_size=GLOBAL_BATCH // WORLD, seq_len=64)


def swap_to_median(profile, specs: list, index: int, predicted_s: dict[str, float]) -> None:
    """Prints the predictions of ``specs[index]`` with one figure at a time set to its median over ``specs``:
    which figure's probe-to-probe spread moved that spec's prediction (and the predicted order)."""
    target = specs[index]
    print(f"spec {index} with one figure at the median of {len(specs)} specs (ms):")
    for figure in FIGURES:
        if figure == "block_tflops_curves":
            tops = sorted(specs, key=lambda s: max(s.model_tflops.values()))
            middle = tops[(len(tops) - 1) // 2]
            spec = dataclasses.replace(
                target, block_tflops_curves=middle.block_tflops_curves, model_tflops=middle.model_tflops
            )
            label = f"{figure} of {middle.name}"
        else:
            value = statistics.median(getattr(s, figure) for s in specs)
            spec = dataclasses.replace(target, **{figure: value})
            label = f"{figure} = {value:.4g}"
        row = predictions_s(profile, spec)
        order = " < ".join(sorted(row, key=row.get))
        cells = ", ".join(f"{name} {row[name] * 1e3:.1f} ({row[name] / predicted_s[name] - 1:+.1%})" for name in row)
        print(f"  {label}: {cells}  ({order})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+", help="hardware spec files (elixir-tune probe --out FILE)")
    parser.add_argument("--step", type=float, default=0.1, help="relative change of each figure (default 0.1)")
    parser.add_argument(
        "--swap",
        type=int,
        default=None,
        metavar="INDEX",
        help="also: the spec at INDEX (0-based) with each figure in turn set to its median over all the specs "
        "(the block curve: the curve of the spec whose top rate is the median), its predictions printed",
    )
    args = parser.parse_args()
    profile = bench_profile()
    loaded = [spec_of(path) for path in args.specs]
    specs = [spec for spec, _ in loaded]
    print("predicted step (ms) per spec:")
    table = []
    for path, (spec, recorded) in zip(args.specs, loaded, strict=True):
        row = predictions_s(profile, spec)
        table.append(row)
        order = " < ".join(sorted(row, key=row.get))
        print(f"  {path}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row.items()) + f"  ({order})")
        if recorded:
            print("    the run predicted " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in recorded.items()))
    if len(table) > 1:
        for name in table[0]:
            values = [row[name] for row in table]
            spread = (max(values) - min(values)) / statistics.median(values)
            print(f"  {name}: spread (max - min) / median {spread:.1%}")
        print("figure spread over the specs, (max - min) / median:")
        for figure in FIGURES:
            if figure == "block_tflops_curves":
                values = [max(s.model_tflops.values()) for s in specs]
            else:
                values = [getattr(s, figure) for s in specs]
            middle = statistics.median(values)
            spread = (max(values) - min(values)) / middle if middle else 0.0
            print(f"  {figure}: {', '.join(f'{v:.4g}' for v in values)}  spread {spread:.0%}")
    if args.swap is not None:
        swap_to_median(profile, specs, args.swap, table[args.swap])
    base = table[0]
    print(f"elasticity on {args.specs[0]} (relative change of the prediction / {args.step:+.0%}):")
    print("  figure".ljust(36) + "".join(name.rjust(12) for name in base))
    for figure in FIGURES:
        row = predictions_s(profile, scaled(specs[0], figure, 1 + args.step))
        cells = "".join(f"{(row[name] / base[name] - 1) / args.step:12.3f}" for name in base)
        print(f"  {figure}".ljust(36) + cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
