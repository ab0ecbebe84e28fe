#!/usr/bin/env python
"""Where the engine's pipeline and tensor steps spend their time on this CPU: micro-batch sweeps.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_layout_sweep.py --out /tmp/sweep.json

Trains the benchmark GPT-2 of ``scripts/bench_prediction.py`` (n_embd 256, 4 layers, seq 64, world 2,
global batch 16) with ``elixir-run`` under the search's best plan of each layout with the micro-batch
size pinned: data only at 8 x 1 (the reference), pipeline 2 at 8 x 2, 4 x 4, 2 x 8, tensor 2 at
16 x 1, 8 x 2, 4 x 4, and data only again. Each rank records its process CPU time (``time.process_time``)
and wall time at every optimizer step: on a machine shared with other work the wall time is mostly
waiting for a core, the CPU time is the work itself (it misses the bubble's and the collectives'
waits, which the cost model prices apart). Every time is scaled by data only's predicted / measured
time (the mean of its runs before and after the others), so that what is compared is the ratio to
data only. A straight line through each layout's (micro-batches, scaled - predicted) points says
what the model misses per micro-batch (its slope: a fixed cost per micro-batch, for the whole
rank) and per step (its intercept).
Prints the table and the fits; measures only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_prediction as bench  # noqa: E402
from bench_prediction_shapes import GLOBAL_BATCH, WORLD  # noqa: E402

SWEEP = (
    ("data-only", {"pipeline": 1, "tensor": 1, "micro_batch_size": 8}),
    ("pipeline-2", {"pipeline": 2, "micro_batch_size": 8}),
    ("pipeline-2", {"pipeline": 2, "micro_batch_size": 4}),
    ("pipeline-2", {"pipeline": 2, "micro_batch_size": 2}),
    ("tensor-2", {"tensor": 2, "micro_batch_size": 16}),
    ("tensor-2", {"tensor": 2, "micro_batch_size": 8}),
    ("tensor-2", {"tensor": 2, "micro_batch_size": 4}),
    ("data-only", {"pipeline": 1, "tensor": 1, "micro_batch_size": 8}),
)


# Records each rank's wall and CPU clocks at every optimizer step; runs scripts/train_gpt2.py unchanged.
CLOCK_WRAPPER = """\
import atexit, json, os, runpy, sys, time
import elixir_tune

_marks = []
_setup = elixir_tune.setup

def setup(*args, **kwargs):
    model, optimizer = _setup(*args, **kwargs)
    step = optimizer.step

    def timed_step(*a, **k):
        out = step(*a, **k)
        _marks.append((time.perf_counter(), time.process_time()))
        return out

    optimizer.step = timed_step
    return model, optimizer

elixir_tune.setup = setup

@atexit.register
def _write():
    with open(os.path.join(os.environ["BENCH_MEM_DIR"], "clock%s.json" % os.environ.get("RANK", "0")), "w") as f:
        json.dump(_marks, f)

sys.argv = [SCRIPT] + sys.argv[1:]
runpy.run_path(SCRIPT, run_name="__main__")
"""


def step_clocks(run_dir: Path, warmup: int) -> tuple[float, float]:
    """(median wall, median CPU seconds per step) of the slower rank, the first ``warmup`` steps dropped."""
    walls, cpus = [], []
    for clock_file in sorted(run_dir.glob("clock*.json")):
        marks = json.loads(clock_file.read_text())
        steps = list(zip(marks, marks[1:], strict=False))[max(0, warmup - 1) :]
        walls.append(statistics.median(b[0] - a[0] for a, b in steps))
        cpus.append(statistics.median(b[1] - a[1] for a, b in steps))
    return max(walls), max(cpus)


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0
    return slope, my - slope * mx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hardware", default="cpu", help="preset id or hardware file the predictions use")
    parser.add_argument("--run-timeout", type=float, default=180.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    from elixir_tune.hardware import load_hardware
    from elixir_tune.profiler import load_model_source, profile_model
    from elixir_tune.search import search

    hardware = load_hardware(args.hardware)
    workdir = Path(tempfile.mkdtemp(prefix="layout_sweep_"))
    model_path = workdir / "gpt2-bench.yaml"
    model_path.write_text(
        bench.MODEL_YAML.format(name="gpt2-bench-256x4", hidden=256, layers=4, heads=4, vocab=256, seq=64)
    )
    (workdir / "wrapper.py").write_text(CLOCK_WRAPPER.replace("SCRIPT", repr(str(REPO / "scripts" / "train_gpt2.py"))))
    profile = profile_model(load_model_source(str(model_path)), batch_size=GLOBAL_BATCH // WORLD, seq_len=64)
    plans = [
        (
            name,
            pins,
            search(profile, hardware, WORLD, global_batch_size=GLOBAL_BATCH, fixed=pins, loop="forward_backward").plan,
        )
        for name, pins in SWEEP
    ]
    runs: dict[int, list[dict]] = {i: [] for i in range(len(plans))}
    uptimes = [os.getloadavg()]
    for round_index in range(args.rounds):
        order = list(range(len(plans)))
        if round_index % 2:
            order.reverse()
        for i in order:
            name, pins, plan = plans[i]
            run_name = f"{i}-{name}-{pins['micro_batch_size']}-round{round_index}"
            measured = bench.run_shape(run_name, plan, workdir, args)
            measured["wall_s"], measured["cpu_s"] = step_clocks(workdir / run_name / "mem", args.warmup)
            runs[i].append(measured)
            bench.say(
                f"{name} mb {pins['micro_batch_size']}: wall {bench.ms(measured['wall_s'])} ms, "
                f"CPU {bench.ms(measured['cpu_s'])} ms per step (load {measured['load_avg_1min_before']})"
            )
    uptimes.append(os.getloadavg())
    rows = []
    for i, (name, pins, plan) in enumerate(plans):
        rows.append(
            {
                "layout": name,
                "micro_batch_size": pins["micro_batch_size"],
                "micro_batches": plan.training.grad_accum_steps,
                "predicted_s": plan.prediction.step_time_s,
                "measured_s": statistics.median(run["cpu_s"] for run in runs[i]),
                "measured_wall_s": statistics.median(run["wall_s"] for run in runs[i]),
                "breakdown": plan.prediction.breakdown,
            }
        )
    # The machine may be loaded: every time is scaled by data only's predicted / measured (the mean of
    # its runs before and after the others), so that what is compared is the ratio to data only.
    data_rows = [r for r in rows if r["layout"] == "data-only"]
    scale = data_rows[0]["predicted_s"] / statistics.mean(r["measured_s"] for r in data_rows)
    for row in rows:
        row["scaled_s"] = row["measured_s"] * scale
        row["ratio_to_data"] = row["measured_s"] * scale / data_rows[0]["predicted_s"]
    print(f"scale (data only predicted / measured CPU time): {scale:.3f}")
    print("| layout | mb x N | predicted ms | wall ms | CPU ms | CPU x scale ms | CPU / data only's |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['layout']} | {row['micro_batch_size']}x{row['micro_batches']} | {row['predicted_s'] * 1e3:.1f} | "
            f"{row['measured_wall_s'] * 1e3:.1f} | {row['measured_s'] * 1e3:.1f} | {row['scaled_s'] * 1e3:.1f} | "
            f"{row['ratio_to_data']:.2f} |"
        )
    fits = {}
    for layout in ("pipeline-2", "tensor-2"):
        points = [r for r in rows if r["layout"] == layout]
        slope, intercept = line_fit(
            [r["micro_batches"] for r in points], [r["scaled_s"] - r["predicted_s"] for r in points]
        )
        fits[layout] = {"missed_per_micro_batch_s": slope, "missed_per_step_s": intercept}
        print(f"{layout}: scaled - predicted = {slope * 1e3:.2f} ms x micro-batches + {intercept * 1e3:.1f} ms")
    print(f"load averages (1, 5, 15 min) at start {uptimes[0]}, end {uptimes[1]}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "fits": fits, "load": uptimes, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
