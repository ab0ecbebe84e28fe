"""Predicted step time and peak memory of the best plan with and without tensor, pipeline and expert parallelism.

For Llama-2 13B and 70B (configs/models, traced on the meta device, bf16, seq 4096) on 2 and 4 nodes x 8
h100-80gb-sxm and 4 nodes x 8 a100-40gb-pcie (configs/hardware presets), and a Mixtral-shaped
mixture of experts (configs/models/mixtral-8x7b.yaml: Mixtral 8x7B's published shapes, 8 experts, 2
per token) on 4 nodes x 8 h100-80gb-sxm, at global batches of 2 and 8 sequences per GPU, the joint
search is run with the parallel layout free and pinned:

* ``free``: the search picks data/pipeline/tensor/expert itself;
* ``dp only``: ``--fix pipeline=1 --fix tensor=1 --fix expert=1`` (the search before model parallelism);
* ``tp T`` (1d) for T = 2, 4, 8 and ``tp 4 (2d)``: ``--fix tensor=T [--fix tensor_mode=2d]``;
* ``pp P`` for P = 2, 4: ``--fix pipeline=P --fix tensor=1``;
* ``pp P x tp T`` (1d, pipeline x tensor x data in one mesh) for (P, T) = (2, 4), (4, 4), (2, 8):
  ``--fix pipeline=P --fix tensor=T``;
* for the mixture of experts, ``ep E`` for E = 2, 4, 8: ``--fix expert=E --fix pipeline=1 --fix tensor=1``
  (expert parallelism runs beside data parallelism only in this version).

Everything is a prediction of the cost model (docs/costmodel-and-search.md), nothing runs.

    .venv/bin/python scripts/bench_tensor_parallel.py      # writes benchmarks/results/tensor-parallel.{json,md}
    .venv/bin/python scripts/bench_tensor_parallel.py --models mixtral-8x7b   # reruns those, keeps the other cases
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from report_meta import generated, with_header, write_pair

from elixir_tune import paths
from elixir_tune.hardware import load_hardware
from elixir_tune.search import InfeasibleError, search

MODELS = ("llama2-13b", "llama2-70b", "mixtral-8x7b")
CLUSTERS = (("h100-80gb-sxm", 8, 2), ("h100-80gb-sxm", 8, 4), ("a100-40gb-pcie", 8, 4))
# Models run on other clusters than CLUSTERS.
MODEL_CLUSTERS = {"mixtral-8x7b": (("h100-80gb-sxm", 8, 4),)}
BATCHES_PER_GPU = (2, 8)
SEQ_LEN = 4096
VARIANTS: tuple[tuple[str, list[str]], ...] = (
    ("free", []),
    ("dp only", ["pipeline=1", "tensor=1", "expert=1", "context=1"]),
    ("tp 2", ["tensor=2", "pipeline=1"]),
    ("tp 4", ["tensor=4", "pipeline=1"]),
    ("tp 8", ["tensor=8", "pipeline=1"]),
    ("tp 4 (2d)", ["tensor=4", "tensor_mode=2d", "pipeline=1"]),
    ("pp 2", ["pipeline=2", "tensor=1"]),
    ("pp 4", ["pipeline=4", "tensor=1"]),
    ("pp 2 x tp 4", ["pipeline=2", "tensor=4"]),
    ("pp 4 x tp 4", ["pipeline=4", "tensor=4"]),
    ("pp 2 x tp 8", ["pipeline=2", "tensor=8"]),
)
# Models with experts (whose config ships an expert plan) also get these.
EXPERT_VARIANTS: tuple[tuple[str, list[str]], ...] = (
    ("ep 2", ["expert=2", "pipeline=1", "tensor=1"]),
    ("ep 4", ["expert=4", "pipeline=1", "tensor=1"]),
    ("ep 8", ["expert=8", "pipeline=1", "tensor=1"]),
)
COMMAND = ".venv/bin/python scripts/bench_tensor_parallel.py"


def run_variant(profile, hardware, gpus: int, nodes: int, batch: int, fixed: list[str]) -> dict:
    """The best plan of one pinned layout, or why there is none."""
    started = time.perf_counter()
    try:
        result = search(
            profile,
            hardware,
            gpus_per_node=gpus,
            nodes=nodes,
            global_batch_size=batch,
            fixed=fixed,
            loop="forward_backward",
        )
    except InfeasibleError as error:
        return {"infeasible": str(error).split("; try:")[0], "search_s": round(time.perf_counter() - started, 2)}
    except ValueError as error:
        return {"not possible": str(error), "search_s": round(time.perf_counter() - started, 2)}
    plan = result.plan
    assert plan.prediction is not None
    best = result.candidates[0]
    return {
        "search_s": round(result.elapsed_s, 2),
        "step_time_s": plan.prediction.step_time_s,
        "tokens_per_s": plan.prediction.tokens_per_s,
        "tflops_per_gpu": plan.prediction.tflops_per_gpu,
        "peak_gpu_bytes": plan.prediction.peak_gpu_bytes,
        "peak_host_bytes": plan.prediction.peak_host_bytes,
        "layout": best.layout.describe(),
        "data": plan.data_parallel_size,
        "breakdown": plan.prediction.breakdown,
        "shape": best.row(),
        "why": result.why,
    }


def _cell(row: dict) -> str:
    if "step_time_s" not in row:
        return "no plan"
    return f"{row['step_time_s']:.3g}"


def _plan(row: dict) -> str:
    if "infeasible" in row:
        return row["infeasible"].replace("|", "/")
    if "not possible" in row:
        return row["not possible"].replace("|", "/")
    s = row["shape"]
    every = s["checkpointing"]
    ckpt = "none" if every == 0 else "all" if every == 1 else f"1/{every}"
    b = row["breakdown"]
    step = row["step_time_s"]
    extra = []
    for key, label in (
        ("tensor_comm_s", "TP comm"),
        ("expert_comm_s", "EP all-to-all"),
        ("pipeline_bubble_s", "bubble"),
        ("exposed_fetch_s", "fetch"),
    ):
        if b.get(key):
            extra.append(f"{label} {b[key] / step:.0%}")
    layout = f"dp {row['data']}" if row["layout"] == "dp only" else f"{row['layout']} x dp {row['data']}"
    return (
        f"{layout}: micro {s['micro_batch_size']} x {s['grad_accum_steps']}"
        f"{' L' if s['accumulation'] == 'layered' else ''}, ckpt {ckpt}, offload {s['offload']:.0%}, "
        f"cache {s['cache_blocks']}/{s['cacheable_chunks']}" + (f"; {', '.join(extra)}" if extra else "")
    )


def markdown(report: dict) -> str:
    lines = [
        "# Tensor and pipeline parallelism: predicted best plans",
        "",
        f"Command: `{report['command']}` ({report['machine']}; {report['elapsed_s']} s in all"
        + (f", load average {report['load_before']} -> {report['load_after']}" if "load_before" in report else "")
        + "; search times depend on the load, predictions do not).",
        "",
        "Predictions of the cost model only (nothing ran): step time of the best plan the joint search finds with "
        "the parallel layout free or pinned, and its peak device memory per GPU (the largest pipeline stage). "
        f"Profiles traced on the meta device, bf16, seq {SEQ_LEN}. `free` lets the search choose; `dp only` is "
        "`--fix pipeline=1 --fix tensor=1` (and `--fix expert=1` for the mixture of experts); `tp T` is `--fix tensor=T --fix pipeline=1`; `pp P` is "
        "`--fix pipeline=P --fix tensor=1`; `pp P x tp T` is `--fix pipeline=P --fix tensor=T` (one mesh, data x "
        "pipeline x tensor); `ep E` is `--fix expert=E --fix pipeline=1 --fix tensor=1` (mixture of experts "
        "only). TFLOPS = model FLOPs / step / GPUs.",
        "",
    ]
    for update in report.get("updates", []):
        lines += [f"Rerun since: `{update['command']}` ({update['models']}; {update['elapsed_s']} s).", ""]
    for case in report["cases"]:
        lines += [
            f"## {case['model']} on {case['nodes']} x {case['gpus_per_node']} x {case['hardware']}, "
            f"global batch {case['global_batch_size']} ({case['global_batch_size'] // (case['nodes'] * case['gpus_per_node'])} per GPU)",
            "",
            "| layout | step s | vs dp only | TFLOPS/GPU | GPU GiB | plan |",
            "|---|---:|---:|---:|---:|---|",
        ]
        base = case["variants"]["dp only"].get("step_time_s")
        for name, row in case["variants"].items():
            ratio = f"{base / row['step_time_s']:.2f}x" if base and "step_time_s" in row else "-"
            tflops = f"{row['tflops_per_gpu']:.0f}" if "tflops_per_gpu" in row else "-"
            gib = f"{row['peak_gpu_bytes'] / 2**30:.1f}" if "peak_gpu_bytes" in row else "-"
            lines.append(f"| {name} | {_cell(row)} | {ratio} | {tflops} | {gib} | {_plan(row)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite PREFIX.md from the existing PREFIX.json (no search)"
    )
    parser.add_argument(
        "--out-prefix",
        default=str(paths.REPO_DIR / "benchmarks" / "results" / "tensor-parallel"),
        help="writes PREFIX.json and PREFIX.md",
    )
    parser.add_argument(
        "--models",
        help=f"comma-separated models to run (default all: {','.join(MODELS)}); the other cases are kept from PREFIX.json",
    )
    args = parser.parse_args()
    prefix = Path(args.out_prefix)
    models = args.models.split(",") if args.models else list(MODELS)
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown} (known: {', '.join(MODELS)})")
    if args.render_only:
        report = json.loads(prefix.with_suffix(".json").read_text())
        prefix.with_suffix(".md").write_text(with_header(markdown(report), report["generated"]))
        return
    from elixir_tune.profiler import profile_model

    load_before = round(os.getloadavg()[0], 2)
    started = time.perf_counter()
    cases = []
    for model_name in models:
        profile = profile_model(
            str(paths.MODEL_CONFIGS_DIR / f"{model_name}.yaml"), batch_size=1, seq_len=SEQ_LEN, dtype="bf16"
        )
        tried = VARIANTS + (EXPERT_VARIANTS if profile.arch.num_experts else ())
        for hardware_name, gpus, nodes in MODEL_CLUSTERS.get(model_name, CLUSTERS):
            hardware = load_hardware(hardware_name)
            for per_gpu in BATCHES_PER_GPU:
                batch = per_gpu * gpus * nodes
                variants = {name: run_variant(profile, hardware, gpus, nodes, batch, fixed) for name, fixed in tried}
                cases.append(
                    {
                        "model": model_name,
                        "hardware": hardware_name,
                        "gpus_per_node": gpus,
                        "nodes": nodes,
                        "global_batch_size": batch,
                        "variants": variants,
                    }
                )
                print(model_name, hardware_name, batch, {k: _cell(v) for k, v in variants.items()}, flush=True)
    elapsed_s = round(time.perf_counter() - started, 1)
    report = {
        "command": COMMAND,
        "machine": f"{platform.node() or 'vm'}, Python {platform.python_version()}",
        "elapsed_s": elapsed_s,
        "load_before": load_before,
        "load_after": round(os.getloadavg()[0], 2),
        "cases": cases,
    }
    if args.models and prefix.with_suffix(".json").is_file():  # keep the cases of the other models
        report = json.loads(prefix.with_suffix(".json").read_text())
        kept = [case for case in report["cases"] if case["model"] not in models]
        report["cases"] = sorted(kept + cases, key=lambda case: MODELS.index(case["model"]))
        updates = [u for u in report.get("updates", []) if u["models"] != ",".join(models)]
        command = f"{COMMAND} --models {','.join(models)}"
        report["updates"] = updates + [
            {"command": command, "models": ",".join(models), "elapsed_s": elapsed_s, "load": load_before}
        ]
    report["generated"] = generated(load_before)  # with --models: the last update's (the cases say which)
    write_pair(prefix, report, with_header(markdown(report), report["generated"]))
    print(f"wrote {prefix}.json and {prefix}.md")


if __name__ == "__main__":
    main()
