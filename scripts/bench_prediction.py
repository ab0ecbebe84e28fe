#!/usr/bin/env python
"""How good are the cost model's predictions on this CPU machine? Predicted against measured.

    .venv/bin/python scripts/bench_prediction.py                       # ~4-5 min on 2 cores
    .venv/bin/python scripts/bench_prediction.py --steps 15 --warmup 3 --preset    # cpu preset, no probe
    .venv/bin/python scripts/bench_prediction.py --layouts     # data only vs pipeline 2 vs tensor 2
                                                               # (benchmarks/results/prediction-cpu-layouts.*)
    elixir-tune probe --out hw.yaml && .venv/bin/python scripts/bench_prediction.py --layouts --hardware hw.yaml
                                                               # probe once, then every run predicts alike

What it does:
  1. measures this machine as ``elixir-tune probe --quick`` does (``cli/probe_engine.probe_with_engine``:
     the probe, then the layout fixed costs measured with the engine), or takes the ``cpu`` preset
     with --preset, or probes without --quick with --full-probe (steadier, a few minutes), or takes a
     spec file written earlier by ``elixir-tune probe`` with --hardware FILE (as a user probes once and
     searches many times: successive runs then share one prediction, and their measured/predicted
     ratios differ only by the measurement);
  2. profiles a small GPT-2 (transformers, n_embd 256, 4 layers, 4 heads, vocab 256, seq 64 by
     default; a model YAML written under a temporary directory);
  3. searches plans for 2 CPU workers at global batch 16: the search's own best, then shapes that
     pin everything to the best's choices but one (cache all / minimum, offload 0.5 / 1,
     checkpointing all, micro-batch 2 x accumulation 4);
  4. runs each plan with ``elixir-run plan.yaml scripts/train_gpt2.py --synthetic --steps N``
     through a thin wrapper that runs train_gpt2.py unchanged (runpy) and, per rank, records
     ``model.memory_report()`` right after ``elixir_tune.setup`` and the process's peak RSS at exit;
  5. compares the predicted step time with the median measured step time (rank 0's log, the first
     ``--warmup`` steps dropped), the predicted model-state bytes with the engine's report, and the
     predicted per-worker memory with the measured RSS growth from just before setup to the peak;
  6. times plain PyTorch forward+backward and AdamW in this process (1 thread, as one worker gets)
     as a reference for the compute part of the prediction.

Prints a table and saves JSON and a markdown table (default benchmarks/results/prediction-cpu.*, with
--layouts prediction-cpu-layouts.*).
Measures only; it does not change the cost model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
BIN = Path(sys.executable).parent

from bench_prediction_reference import plain_reference, plain_rss_reference, plain_step_s  # noqa: E402
from bench_prediction_report import describe, markdown, mib, ms, rank_order, spearman, tie_ranking  # noqa: E402
from bench_prediction_shapes import GLOBAL_BATCH, WORLD, layout_shapes, make_shapes, shape_of  # noqa: E402
from report_meta import generated, with_header  # noqa: E402

# A GPT-2 model YAML (configs/models/ format) without dropout; gpu_validate.py sizes its model with it too.
MODEL_YAML = """\
name: {name}
architecture: gpt2
seq_len: {seq}
config:
  n_embd: {hidden}
  n_layer: {layers}
  n_head: {heads}
  n_positions: {seq}
  vocab_size: {vocab}
  bos_token_id: 0
  eos_token_id: 0
  resid_pdrop: 0.0
  embd_pdrop: 0.0
  attn_pdrop: 0.0
"""

# Runs scripts/train_gpt2.py unchanged; adds, per rank, the engine's memory report and the RSS figures.
WRAPPER = """\
import atexit, json, os, resource, runpy, sys
import elixir_tune

_out = os.environ["BENCH_MEM_DIR"]
_rank = os.environ.get("RANK", "0")
_record = {}

def _rss_bytes():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def _peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

_setup = elixir_tune.setup

def setup(*args, **kwargs):
    _record["rss_before_setup_bytes"] = _rss_bytes()
    _record["peak_rss_before_setup_bytes"] = _peak_rss_bytes()
    model, optimizer = _setup(*args, **kwargs)
    _record["rss_after_setup_bytes"] = _rss_bytes()
    _record["memory_report"] = model.memory_report()
    return model, optimizer

elixir_tune.setup = setup

@atexit.register
def _write():
    _record["rss_at_exit_bytes"] = _rss_bytes()
    _record["peak_rss_bytes"] = _peak_rss_bytes()
    with open(os.path.join(_out, f"rank{_rank}.json"), "w") as f:
        json.dump(_record, f)

sys.argv = [SCRIPT] + sys.argv[1:]
runpy.run_path(SCRIPT, run_name="__main__")
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15, help="training steps per shape")
    parser.add_argument("--warmup", type=int, default=3, help="first steps dropped from the median")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="runs per shape, in alternating order (the machine is shared; this spreads drift); default 2, "
        "4 with --layouts (one run slowed by other work on the machine then cannot decide the pooled median). "
        "An even count puts every shape at the same mean position in time (ABC CBA ...), so a steady drift "
        "of the machine's speed slows none more than another; with 3 the last shape of round 1 ran latest",
    )
    hardware = parser.add_mutually_exclusive_group()
    hardware.add_argument("--preset", action="store_true", help="use the cpu preset instead of a quick probe")
    hardware.add_argument(
        "--hardware",
        default=None,
        metavar="FILE",
        help="a spec written by `elixir-tune probe --out FILE` instead of a fresh quick probe",
    )
    hardware.add_argument(
        "--full-probe",
        action="store_true",
        help="a fresh full probe (`elixir-tune probe` without --quick: more sizes, rounds and engine steps, "
        "a few minutes) instead of the quick one",
    )
    parser.add_argument(
        "--layouts",
        action="store_true",
        help="instead of the chunk-engine shapes: the best plan of data parallelism only, pipeline 2 and tensor 2",
    )
    parser.add_argument("--run-timeout", type=float, default=180.0, help="seconds per elixir-run")
    parser.add_argument(
        "--out", default=None, help="JSON results (default benchmarks/results/prediction-cpu[-layouts].json)"
    )
    parser.add_argument("--md", default=None, help="markdown table (default the JSON's path with .md)")
    args = parser.parse_args()
    if args.hardware is not None and not Path(args.hardware).is_file():
        parser.error(f"--hardware {args.hardware}: no such file; write one with `elixir-tune probe --out FILE`")
    if args.rounds is None:
        args.rounds = 4 if args.layouts else 2
    results = REPO / "benchmarks" / "results"
    if args.out is None:
        args.out = str(results / ("prediction-cpu-layouts.json" if args.layouts else "prediction-cpu.json"))
    if args.md is None:
        args.md = str(Path(args.out).with_suffix(".md"))
    return args


def say(message: str) -> None:
    print(f"[bench_prediction {time.strftime('%H:%M:%S')}] {message}", flush=True)


def reports_match(report: dict | None, prediction) -> bool:
    """Whether the engine's ``memory_report()`` has the predicted model-state and transient bytes (every key)."""
    expected = {**prediction.model_state_bytes, **prediction.transient_bytes}
    return report is not None and all(report.get(key) == value for key, value in expected.items())


def rank_predictions(profile, hardware, plan) -> list:
    """Each rank's promised memory: its pipeline stage's entry of the plan's prediction (stages hold
    different chunks), the plan's own figures without a pipeline (``Plan.rank_memory``)."""
    return [plan.rank_memory(rank) for rank in range(plan.world_size)]


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs so far (/proc/stat; (0, 0) where there is none)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def run_shape(name: str, plan, workdir: Path, args, extra_env: dict | None = None) -> dict:
    """Trains one plan with elixir-run; returns measured step times and per-rank memory."""
    from elixir_tune.plan import save_plan

    shape_dir = workdir / name
    while shape_dir.exists():  # a later round of the same shape
        shape_dir = shape_dir.with_name(shape_dir.name + "+")
    mem_dir = shape_dir / "mem"
    mem_dir.mkdir(parents=True)
    plan_path = shape_dir / "plan.yaml"
    save_plan(plan, plan_path)
    log_path = shape_dir / "train.json"
    command = [
        str(BIN / "elixir-run"),
        str(plan_path),
        str(workdir / "wrapper.py"),
        "--synthetic",
        "--steps",
        str(args.steps),
        "--log",
        str(log_path),
    ]
    env = {**os.environ, "BENCH_MEM_DIR": str(mem_dir), **(extra_env or {})}
    load_before = os.getloadavg()[0]
    steal_before, total_before = cpu_ticks()
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.run_timeout)
    wall_s = time.perf_counter() - started
    steal_after, total_after = cpu_ticks()
    if proc.returncode != 0 or not log_path.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{name}: elixir-run exited {proc.returncode}:\n{tail}")
    log = json.loads(log_path.read_text())
    times = [s["step_time_s"] for s in log["steps"]]
    timed = times[args.warmup :]
    ranks = [
        json.loads((mem_dir / f"rank{r}.json").read_text())
        for r in range(plan.world_size)
        if (mem_dir / f"rank{r}.json").exists()
    ]
    return {
        "wall_s": round(wall_s, 1),
        "load_avg_1min_before": round(load_before, 2),
        "load_avg_1min_after": round(os.getloadavg()[0], 2),
        # A VM's stolen time (the hypervisor ran someone else on our vCPUs): noise no code here causes.
        "cpu_steal_share": round((steal_after - steal_before) / max(1, total_after - total_before), 4),
        "step_times_s": [round(t, 5) for t in times],
        "median_step_time_s": statistics.median(timed),
        "min_step_time_s": min(timed),
        "max_step_time_s": max(timed),
        "first_loss": log["summary"]["first_loss"],
        "last_loss": log["summary"]["last_loss"],
        "train_log_peak_rss_rank0_bytes": log["summary"]["peak_memory_bytes"],
        "ranks": ranks,
    }


def pool(runs: list[dict], warmup: int) -> dict:
    """One shape's runs merged: the median over the timed steps of all rounds, and each round's median."""
    timed = [t for run in runs for t in run["step_times_s"][warmup:]]
    return {
        "median_step_time_s": statistics.median(timed),
        "min_step_time_s": min(timed),
        "max_step_time_s": max(timed),
        "round_medians_s": [round(run["median_step_time_s"], 5) for run in runs],
        "ranks": runs[0]["ranks"],
        "runs": runs,
    }


def no_overlap_sum_s(breakdown: dict) -> float:
    """The predicted parts added up as if nothing overlapped (a diagnostic, not the cost model's answer):
    compute (recompute included), all-gathers, reduce-scatters, host copies, the optimizer step and
    layered accumulation's thread hand-overs."""
    return sum(
        breakdown.get(key, 0.0)
        for key in (
            "compute_s",
            "allgather_s",
            "reduce_scatter_s",
            "h2d_s",
            "d2h_s",
            "optimizer_gpu_s",
            "optimizer_cpu_s",
            "thread_handoff_s",
        )
    )


def world1_reference(profile, hardware, best_plan, workdir: Path, args) -> dict:
    """The engine alone, no gloo peer: a world-1 plan (every chunk cached, nothing offloaded, the best's
    chunk size and micro-batch) trained with 1 thread, as one world-2 worker gets. Against the plain
    PyTorch reference this isolates the engine's own overhead (hooks, chunk copies, Python)."""
    from elixir_tune.search import search

    training = best_plan.training
    pins = {
        "chunk_size": best_plan.memory.chunk_size,
        "cache_blocks": "all",
        "offload": 0.0,
        "micro_batch_size": training.micro_batch_size,
        "checkpointing": 0,
    }
    result = search(profile, hardware, 1, global_batch_size=GLOBAL_BATCH // WORLD, fixed=pins, loop="forward_backward")
    say(
        f"world-1 engine reference: {describe(shape_of(result.plan))}: predicted "
        f"{ms(result.plan.prediction.step_time_s)} ms; running"
    )
    measured = run_shape("world1", result.plan, workdir, args, extra_env={"OMP_NUM_THREADS": "1"})
    say(f"world-1 engine reference: measured median {ms(measured['median_step_time_s'])} ms")
    pred = result.plan.prediction
    rank0 = measured["ranks"][0] if measured["ranks"] else {}
    return {
        "pins": pins,
        "shape": shape_of(result.plan),
        "predicted_step_time_s": result.plan.prediction.step_time_s,
        "predicted_worker_bytes": pred.peak_gpu_bytes + pred.peak_host_bytes,
        "measured_rss_growth_bytes": rank0.get("peak_rss_bytes", 0) - rank0.get("rss_before_setup_bytes", 0),
        "model_state_bytes_match": reports_match(rank0.get("memory_report"), pred),
        "predicted_breakdown": result.plan.prediction.breakdown,
        "measured_median_step_time_s": measured["median_step_time_s"],
        "measured": measured,
    }


def main() -> int:
    args = parse_args()
    started = time.perf_counter()
    import torch

    from elixir_tune.cli.probe_engine import probe_with_engine
    from elixir_tune.hardware import load_hardware
    from elixir_tune.profiler import load_model_source, profile_model

    command = "scripts/bench_prediction.py " + " ".join(sys.argv[1:])
    if args.preset:
        hardware, hw_how = load_hardware("cpu"), "preset cpu"
    elif args.hardware is not None:
        try:
            hardware = load_hardware(args.hardware)
        except ValueError as error:
            print(f"bench_prediction.py: --hardware: {error}", file=sys.stderr)
            return 2
        hw_how = f"spec file {args.hardware} ({hardware.name})"
    else:
        quick = not args.full_probe
        say(f"probing this machine ({'quick' if quick else 'full'})")
        hardware = probe_with_engine(quick=quick, procs=WORLD, device="cpu")
        hw_how = f"probe_with_engine(quick={quick}, procs=2): elixir-tune probe{' --quick' if quick else ''}"
    hw_fields = {
        k: getattr(hardware, k)
        for k in (
            "name",
            "device_name",
            "matmul_tflops",
            "model_tflops",
            "block_tflops_curves",
            "hbm_gbps",
            "h2d_gbps",
            "h2d_gbps_all",
            "allgather_gbps",
            "reduce_scatter_gbps",
            "collective_latency_s",
            "copy_latency_s",
            "gpu_adam_elems_per_s",
            "cpu_adam_elems_per_s",
            "usable_memory_bytes",
            "host_cores",
            "block_call_overhead_s",
            "pointwise_gbps",
            "thread_handoff_s",
            "tensor2_block_extra_ratio",
            "tensor2_block_fixed_s",
            "pipeline_microbatch_extra_ratio",
            "pipeline_stage_microbatch_s",
        )
    }
    say(
        f"hardware ({hw_how}): fp32 {hardware.matmul_tflops.get('fp32')} TFLOP/s, all-gather "
        f"{hardware.allgather_gbps} GB/s, reduce-scatter {hardware.reduce_scatter_gbps} GB/s, collective latency "
        f"{hardware.collective_latency_s * 1e6:.0f} us, Adam {hardware.cpu_adam_elems_per_s:.2e} elem/s"
    )

    workdir = Path(tempfile.mkdtemp(prefix="bench_prediction_"))
    model_path = workdir / "gpt2-bench.yaml"
    model_path.write_text(
        MODEL_YAML.format(
            name=f"gpt2-bench-{args.hidden}x{args.layers}",
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            vocab=args.vocab,
            seq=args.seq,
        )
    )
    (workdir / "wrapper.py").write_text(WRAPPER.replace("SCRIPT", repr(str(REPO / "scripts" / "train_gpt2.py"))))
    source = load_model_source(str(model_path))
    profile = profile_model(source, batch_size=GLOBAL_BATCH // WORLD, seq_len=args.seq)
    say(
        f"profiled {profile.name}: {profile.num_params:,} parameters, "
        f"{profile.flops_per_sample / args.seq / 1e9:.4f} GFLOP per token"
    )

    shapes = layout_shapes(profile, hardware) if args.layouts else make_shapes(profile, hardware, say)
    say(f"{len(shapes)} shapes: " + ", ".join(name for name, _, _ in shapes))
    plain = plain_reference(source, profile, args)
    say(
        f"plain PyTorch, 1 thread: fwd+bwd 8x1 {ms(plain['fwd_bwd_8x1_s'])} ms, 2x4 {ms(plain['fwd_bwd_2x4_s'])} ms, "
        f"AdamW {ms(plain['adamw_step_s'])} ms"
    )
    plain_rss = plain_rss_reference(model_path, profile, args, GLOBAL_BATCH // WORLD)
    if "growth_bytes" in plain_rss:
        say(
            f"plain PyTorch peak RSS growth at micro-batch 8: {mib(plain_rss['growth_bytes'])} MiB "
            f"(profile activations + 16 B/param: {mib(plain_rss['predicted_bytes'])} MiB)"
        )
    load_start = os.getloadavg()[0]
    torch.manual_seed(0)
    speed_model = source.build_model()

    runs: dict[str, list[dict]] = {name: [] for name, _, _ in shapes}
    for round_index in range(args.rounds):
        order = shapes if round_index % 2 == 0 else shapes[::-1]
        for name, _pins, result in order:
            plan = result.plan
            say(
                f"round {round_index + 1}, {name}: {describe(shape_of(plan))}: predicted "
                f"{ms(plan.prediction.step_time_s)} ms; running"
            )
            speed_s = plain_step_s(speed_model, args)
            measured = run_shape(name, plan, workdir, args)
            measured["plain_fwd_bwd_8x1_before_s"] = round(speed_s, 5)
            runs[name].append(measured)
            say(
                f"round {round_index + 1}, {name}: measured median {ms(measured['median_step_time_s'])} ms "
                f"(plain PyTorch 8 x 1 just before: {ms(speed_s)} ms) "
                f"(wall {measured['wall_s']} s, load {measured['load_avg_1min_before']}, "
                f"steal {measured['cpu_steal_share']:.1%})"
            )
    world1 = world1_reference(profile, hardware, shapes[0][2].plan, workdir, args)

    rows = []
    for name, pins, result in shapes:
        plan = result.plan
        measured = pool(runs[name], args.warmup)
        pred = plan.prediction
        engine_reports = [r.get("memory_report") for r in measured["ranks"]]
        expected = rank_predictions(profile, hardware, plan)
        states_match = bool(engine_reports) and all(
            reports_match(rep, want) for rep, want in zip(engine_reports, expected, strict=False)
        )
        # On the CPU the "device" and the "host" are the same RAM: a worker holds its device part and its
        # share of the node's host part.
        pred_worker_bytes = pred.peak_gpu_bytes + pred.peak_host_bytes // WORLD
        growth = [r["peak_rss_bytes"] - r["rss_before_setup_bytes"] for r in measured["ranks"]]
        rows.append(
            {
                "name": name,
                "pins": pins,
                "shape": shape_of(plan),
                "predicted_step_time_s": pred.step_time_s,
                "predicted_breakdown": pred.breakdown,
                "measured_median_step_time_s": measured["median_step_time_s"],
                "ratio_measured_over_predicted": measured["median_step_time_s"] / pred.step_time_s,
                "predicted_model_state_bytes": pred.model_state_bytes,
                "engine_memory_report_per_rank": engine_reports,
                "model_state_bytes_match": states_match,
                "predicted_peak_device_bytes": pred.peak_gpu_bytes,
                "predicted_peak_host_bytes_node": pred.peak_host_bytes,
                "predicted_worker_bytes": pred_worker_bytes,
                "predicted_worker_bytes_per_rank": [m.peak_gpu_bytes + m.peak_host_bytes // WORLD for m in expected],
                "measured_peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in measured["ranks"]],
                "measured_rss_before_setup_bytes_per_rank": [r["rss_before_setup_bytes"] for r in measured["ranks"]],
                "measured_rss_growth_bytes_per_rank": growth,
                "no_overlap_sum_s": no_overlap_sum_s(pred.breakdown),
                "measured": measured,
            }
        )

    plain_after = plain_reference(source, profile, args)
    say(f"plain PyTorch again after the runs: fwd+bwd 8x1 {ms(plain_after['fwd_bwd_8x1_s'])} ms")
    predicted = [r["predicted_step_time_s"] for r in rows]
    measured_t = [r["measured_median_step_time_s"] for r in rows]
    pred_rank, meas_rank = rank_order(predicted), rank_order(measured_t)
    for row, p, m in zip(rows, pred_rank, meas_rank, strict=True):
        row["predicted_rank"], row["measured_rank"] = p, m
    fastest_pred = [r["name"] for r in rows if r["predicted_rank"] == 1]
    fastest_meas = min(rows, key=lambda r: r["measured_median_step_time_s"])["name"]
    ranking = {
        "predicted_fastest": fastest_pred,
        "measured_fastest": fastest_meas,
        "agree": fastest_meas in fastest_pred,
        "spearman": round(spearman(predicted, measured_t), 3),
        "measured_fastest_by_min": min(rows, key=lambda r: r["measured"]["min_step_time_s"])["name"],
        "spearman_by_min": round(spearman(predicted, [r["measured"]["min_step_time_s"] for r in rows]), 3),
        **tie_ranking(rows),
    }
    elapsed = time.perf_counter() - started
    record = {
        "device": "cpu",
        "cpu": hardware.device_name or platform.processor(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": command,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "vocab": args.vocab,
            "seq": args.seq,
            "num_params": profile.num_params,
            "pointwise_bytes_per_sample": profile.pointwise_bytes_per_sample,
        },
        "world_size": WORLD,
        "global_batch_size": GLOBAL_BATCH,
        "steps": args.steps,
        "warmup": args.warmup,
        "hardware_source": hw_how,
        "hardware": hw_fields,
        "layout_cost_sources": {
            key: hardware.sources.get(key, "")
            for key in ("tensor2_block_fixed_s", "pipeline_stage_microbatch_s")
            if hardware.sources.get(key)
        },
        "plain_pytorch_1thread": plain,
        "plain_pytorch_1thread_after": plain_after,
        "load_avg_1min_at_start": round(load_start, 2),
        "load_avg_1min_at_end": round(os.getloadavg()[0], 2),
        "rounds": args.rounds,
        "world1_engine_reference": world1,
        "plain_pytorch_rss": plain_rss,
        "shapes": rows,
        "ranking": ranking,
        "elapsed_s": round(elapsed, 1),
    }
    record["generated"] = generated(round(load_start, 2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    md = with_header(markdown(record), record["generated"])
    Path(args.md).write_text(md)
    print()
    print(md)
    say(f"done in {elapsed:.0f} s; saved {args.out} and {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
