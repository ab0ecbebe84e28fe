"""Benchmark of `elixir-tune search`: how fast it is, and what it predicts against Elixir's rule.

1. Search time (median of --repeats runs) and candidates scored per second for gpt2-20b on
   4 x a100-40gb-pcie (target: under 10 s) and opt-175b on 2 nodes x 8 a100-80gb-sxm (under 60 s).
2. Predicted TFLOPS per GPU (model FLOPs, recomputation not counted) of the joint search and of
   Elixir's rule scored by the same cost model, for gpt2-4b/10b/15b/20b on 1, 2 and 4 x
   a100-40gb-pcie at a batch of 8 per GPU.

Profiles come from the profiler (meta device, seconds each; nothing is cached), or with
--synthetic from the analytic GPT-2 builder (no opt-175b then).

    .venv/bin/python scripts/bench_search.py                 # writes benchmarks/results/search-bench.{json,md}
    .venv/bin/python scripts/bench_search.py --synthetic --repeats 1 --out-prefix /tmp/search
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

from report_meta import generated, load_average, with_header, write_pair

from elixir_tune import paths
from elixir_tune.hardware import load_hardware
from elixir_tune.search import InfeasibleError, search

TABLE_MODELS = ("gpt2-4b", "gpt2-10b", "gpt2-15b", "gpt2-20b")
TABLE_GPUS = (1, 2, 4)
BATCH_PER_GPU = 8


def get_profile(name: str, synthetic: bool):
    """(profile, seconds it took to build)."""
    started = time.perf_counter()
    if synthetic:
        from elixir_tune.costmodel.synthetic import gpt2_profile

        profile = gpt2_profile(name)
    else:
        from elixir_tune.profiler import profile_model

        profile = profile_model(str(paths.MODEL_CONFIGS_DIR / f"{name}.yaml"), batch_size=8, seq_len=1024, dtype="bf16")
    return profile, time.perf_counter() - started


def time_search(profile, hardware, gpus: int, nodes: int, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        result = search(profile, hardware, gpus_per_node=gpus, nodes=nodes, loop="forward_backward")
        runs.append(result)
    elapsed = [r.elapsed_s for r in runs]
    best = runs[-1].candidates[0]
    return {
        "model": profile.name,
        "hardware": hardware.name,
        "nodes": nodes,
        "gpus_per_node": gpus,
        "search_s_median": round(statistics.median(elapsed), 3),
        "search_s_runs": [round(e, 3) for e in elapsed],
        "candidates_scored": runs[-1].num_scored,
        "candidates_per_s": round(runs[-1].num_scored / statistics.median(elapsed), 1),
        "best": best.row(),
        "why": runs[-1].why,
    }


def compare(profile, hardware, gpus: int) -> dict:
    row = {"model": profile.name, "gpus": gpus, "global_batch_size": BATCH_PER_GPU * gpus}
    for strategy in ("joint", "elixir"):
        try:
            result = search(profile, hardware, gpus_per_node=gpus, strategy=strategy)
            row[strategy] = result.candidates[0].row()
        except InfeasibleError as error:
            row[strategy] = {"infeasible": str(error).split("; try:")[0]}
    joint, elixir = row["joint"], row["elixir"]
    if "tflops_per_gpu" in joint and "tflops_per_gpu" in elixir:
        row["speedup"] = round(joint["tflops_per_gpu"] / elixir["tflops_per_gpu"], 3)
    return row


def _shape(row: dict) -> str:
    if "infeasible" in row:
        return "does not fit"
    every = row["checkpointing"]
    ckpt = "none" if every == 0 else "all" if every == 1 else f"1/{every}"
    return (
        f"{row['chunk_mib']:.0f} MiB, cache {row['cache_blocks']}/{row['cacheable_chunks']}, "
        f"offload {row['offload']:.0%}, ckpt {ckpt}, {row['micro_batch_size']}x{row['grad_accum_steps']}"
    )


def markdown(report: dict) -> str:
    lines = [
        "# Search benchmark",
        "",
        f"Machine: {report['machine']}. Profiles: {report['profiles']}. Reproduce: `{report['command']}`.",
        "",
        "## Search time",
        "",
        "| model | cluster | search s (median) | candidates scored | candidates/s | best TFLOPS/GPU | target |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for timing, target in zip(report["timings"], ("< 10 s", "< 60 s"), strict=False):
        lines.append(
            f"| {timing['model']} | {timing['nodes']} x {timing['gpus_per_node']} x {timing['hardware']} | "
            f"{timing['search_s_median']} | {timing['candidates_scored']} | {timing['candidates_per_s']} | "
            f"{timing['best']['tflops_per_gpu']:.1f} | {target} |"
        )
    lines += [
        "",
        f"## Predicted TFLOPS per GPU, joint search vs Elixir's rule (same cost model), "
        f"a100-40gb-pcie, batch {BATCH_PER_GPU} per GPU",
        "",
        "TFLOPS = model FLOPs (6 x params x tokens, recomputation not counted) / predicted step time / GPUs.",
        "",
        "| model | GPUs | joint | Elixir rule | joint / Elixir | joint plan | Elixir-rule plan |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for row in report["comparison"]:
        joint, elixir = row["joint"], row["elixir"]
        cell = lambda r: f"{r['tflops_per_gpu']:.1f}" if "tflops_per_gpu" in r else "OOM"  # noqa: E731
        lines.append(
            f"| {row['model']} | {row['gpus']} | {cell(joint)} | {cell(elixir)} | "
            f"{row.get('speedup', '-')} | {_shape(joint)} | {_shape(elixir)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic", action="store_true", help="analytic GPT-2 profiles instead of traced ones")
    parser.add_argument("--repeats", type=int, default=3, help="search runs per timing (median reported)")
    parser.add_argument(
        "--out-prefix",
        default=str(paths.REPO_DIR / "benchmarks" / "results" / "search-bench"),
        help="writes PREFIX.json and PREFIX.md",
    )
    args = parser.parse_args()
    load_before = load_average()

    a100 = load_hardware("a100-40gb-pcie")
    dgx = load_hardware("a100-80gb-sxm")
    profiles, profile_s = {}, {}
    names = list(TABLE_MODELS) + ([] if args.synthetic else ["opt-175b"])
    for name in names:
        profiles[name], profile_s[name] = get_profile(name, args.synthetic)
        print(f"profile {name}: {profile_s[name]:.1f} s", flush=True)

    timings = [time_search(profiles["gpt2-20b"], a100, gpus=4, nodes=1, repeats=args.repeats)]
    if "opt-175b" in profiles:
        timings.append(time_search(profiles["opt-175b"], dgx, gpus=8, nodes=2, repeats=args.repeats))
    for timing in timings:
        print(
            f"search {timing['model']} on {timing['nodes']}x{timing['gpus_per_node']} {timing['hardware']}: "
            f"{timing['search_s_median']} s, {timing['candidates_scored']} scored, "
            f"{timing['candidates_per_s']} /s",
            flush=True,
        )

    comparison = []
    for name in TABLE_MODELS:
        for gpus in TABLE_GPUS:
            row = compare(profiles[name], a100, gpus)
            comparison.append(row)
            print(
                f"{name} x{gpus}: joint {row['joint'].get('tflops_per_gpu', 'OOM')} "
                f"elixir {row['elixir'].get('tflops_per_gpu', 'OOM')} TFLOPS/GPU",
                flush=True,
            )

    report = {
        "machine": f"{platform.node() or 'host'}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "profiles": "analytic (costmodel.synthetic)"
        if args.synthetic
        else "traced by elixir_tune.profiler (bf16, seq 1024)",
        "command": "python scripts/bench_search.py" + (" --synthetic" if args.synthetic else ""),
        "profile_s": {k: round(v, 2) for k, v in profile_s.items()},
        "timings": timings,
        "comparison": comparison,
    }
    report["generated"] = generated(load_before)
    prefix = Path(args.out_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    text = with_header(markdown(report), report["generated"])
    write_pair(prefix, report, text)
    print(text)
    print(f"wrote {prefix.with_suffix('.json')} and {prefix.with_suffix('.md')}")


if __name__ == "__main__":
    main()
