#!/usr/bin/env python
"""Predicted against measured peak memory per rank on this CPU for GPT-2 shapes the tests never had, at
offload 0, 0.5 and 1 (world 2, gloo), and the per-rank peak of setting up a 774M GPT-2 from a Hugging
Face directory under the search's default plan.

    python scripts/bench_memory_cpu.py                     # both parts, writes benchmarks/results/memory-cpu.*
    python scripts/bench_memory_cpu.py --part shapes       # the three shapes x three offload shares only
    python scripts/bench_memory_cpu.py --part setup        # the 774M setup only (writes ~3.1 GB under /tmp)

**Shapes.** Each shape (``SHAPES``: widths, depths, vocabularies and sequence lengths unlike the tests'
GPT-2s) is profiled, a plan searched at world 2 on the ``cpu`` preset with the issue's pins (2 cache blocks,
micro-batch 4, fp32, no checkpointing, the search's chunk size and prefetch) and the offload share
pinned, then trained one warm-up and one measured step in one launch of two processes
(tests/distributed/memory_fidelity_worker.py). Measured as the engine's memory test measures
(tests/distributed/memory_probe.py): the live tensor storages at the step's start plus the step's
allocation peak. Predicted: the plan's device peak plus this rank's share of the node's host peak (on a
CPU device the two are one pool). The issue's bar: measured within 0.8-1.05x of predicted.

**Setup.** A GPT-2 of 774M parameters built from its config with random weights and written with
``save_pretrained`` into a directory under /tmp (deleted afterwards); profiled; the search's plan at
world 2 on the ``cpu`` preset with nothing pinned; then each rank builds the model on the meta device
and ``elixir_tune.setup(model, optimizer, plan=plan, weights=DIR)`` reads the weights, as the
fine-tuning recipe does. Each rank reports ``ru_maxrss`` after setup against the bound half the fp32
model + 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results" / "memory-cpu"
GIB, MIB = 2**30, 2**20
RATIO_RANGE = (0.8, 1.05)
OFFLOAD_SHARES = (0.0, 0.5, 1.0)

# GPT-2 shapes none of the tests has (configs/models/ format): the real byte-pair vocabulary (a large tied
# embedding and its logits), a deep narrow one, a wide short one.
SHAPES = {
    "gpt2-vocab50k-13m": dict(n_embd=256, n_layer=2, n_head=4, n_positions=128, vocab_size=50257, seq_len=128),
    "gpt2-deep-10m": dict(n_embd=256, n_layer=12, n_head=4, n_positions=256, vocab_size=4096, seq_len=256),
    "gpt2-wide-20m": dict(n_embd=768, n_layer=2, n_head=12, n_positions=64, vocab_size=8192, seq_len=64),
}


def model_yaml(name: str, shape: dict) -> str:
    """A configs/models/ YAML of one shape (no dropout: the CPU's flash attention path)."""
    config = {k: v for k, v in shape.items() if k != "seq_len"}
    lines = [f"name: {name}", "architecture: gpt2", f"seq_len: {shape['seq_len']}", "config:"]
    lines += [f"  {key}: {value}" for key, value in config.items()]
    lines += ["  bos_token_id: 0", "  eos_token_id: 0"]
    lines += [f"  {p}: 0.0" for p in ("resid_pdrop", "embd_pdrop", "attn_pdrop")]
    return "\n".join(lines) + "\n"


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


def run_shapes(shapes: list[str]) -> list[dict]:
    """Every shape at every offload share, in one launch of two ranks; one row per shape, share and rank."""
    from tests.distributed.engine_launch import launch

    rows = []
    with tempfile.TemporaryDirectory(prefix="elixir-memory-cpu-") as tmp:
        cases = []
        for name in shapes:
            path = Path(tmp, f"{name}.yaml")
            path.write_text(model_yaml(name, SHAPES[name]))
            for offload in OFFLOAD_SHARES:
                fixed = dict(offload=offload, cache_blocks=2, checkpointing="none")
                cases.append(
                    dict(model=str(path), fixed=fixed, micro_batch_size=4, accum=1, dtype="fp32", chunk_size=None)
                )
        results = launch("memory_fidelity_worker.py", cases, world_size=2, timeout_s=1800)
    for rank, per_case in enumerate(results):
        for result in per_case:
            if not result["ok"]:
                raise SystemExit(f"rank {rank}: {result.get('error')}\n{result.get('trace')}")
            measured = result["measured"]["peak_bytes"]
            predicted = result["predicted_gpu_bytes"] + result["predicted_host_bytes_per_rank"]
            rows.append(
                {
                    "shape": Path(result["case"]["model"]).stem,
                    "offload": result["case"]["fixed"]["offload"],
                    "rank": rank,
                    "measured_bytes": measured,
                    "predicted_bytes": predicted,
                    "ratio": measured / predicted,
                    "live_bytes": result["measured"]["live_bytes"],
                    "step_peak_bytes": result["measured"]["step_peak_bytes"],
                    "predicted_activation_bytes": result["predicted_activation_bytes"],
                    "predicted_buffer_bytes": result["predicted_buffer_bytes"],
                    "engine_report_bytes": result["report_bytes"],
                    "plan": result["plan"],
                }
            )
    return rows


SETUP_MODEL = "gpt2-774m"
SETUP_DIR = Path("/tmp/elixir-memory-cpu-gpt2-774m")


def cli(*argv: str) -> None:
    """``elixir-tune ARGV`` as a user runs it (this checkout's package)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), TRANSFORMERS_VERBOSITY="error")
    subprocess.run([sys.executable, "-m", "elixir_tune.cli.main", *argv], check=True, env=env, cwd=REPO)


def write_model_dir(directory: Path) -> None:
    """GPT-2 774M built from its config (random weights) and written with ``save_pretrained``, in a child
    process (it holds the whole model)."""
    code = (
        f"import torch, sys; sys.path.insert(0, {str(REPO)!r}); torch.manual_seed(0)\n"
        "from elixir_tune.profiler import load_model_source\n"
        f"load_model_source({SETUP_MODEL!r}).build_model().save_pretrained({str(directory)!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, TRANSFORMERS_VERBOSITY="error"))


def setup_worker(model_dir: Path, plan_path: Path, out: Path) -> None:
    """One rank as the fine-tuning recipe sets up: the model built on the meta device from the directory's
    config, AdamW, ``setup(..., weights=DIR)``; ``ru_maxrss`` after it."""
    import resource

    import torch

    import elixir_tune
    from elixir_tune.plan import load_plan
    from elixir_tune.profiler import load_model_source

    torch.set_num_threads(1)
    start = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    plan = load_plan(plan_path)
    with torch.device("meta"):
        model = load_model_source(str(model_dir)).build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    model, optimizer = elixir_tune.setup(model, optimizer, plan=plan, weights=model_dir)
    setup_s = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine = model.engine
    out.write_text(
        json.dumps(
            {
                "rank": int(os.environ["RANK"]),
                "peak_rss_bytes": peak,
                "rss_start_bytes": start,
                "setup_s": round(setup_s, 1),
                "master_shard_bytes": sum(chunk.master.nbytes for chunk in engine.chunks),
                "engine_report": engine.memory_report(),
            }
        )
    )


def run_setup(keep_dir: bool) -> dict:
    """The 774M directory written, profiled and searched as a user does, set up on 2 ranks; the directory
    deleted unless ``keep_dir``."""
    import shutil

    from elixir_tune.plan import load_plan
    from tests.distributed.engine_launch import free_port

    fresh = not any(SETUP_DIR.glob("*.safetensors"))
    if fresh:
        write_model_dir(SETUP_DIR)
    try:
        with tempfile.TemporaryDirectory(prefix="elixir-memory-setup-") as tmp:
            profile, plan_path = Path(tmp, "profile.yaml"), Path(tmp, "plan.yaml")
            cli("profile", str(SETUP_DIR), "--out", str(profile))
            cli("search", "--gpus", "2", "--hardware", "cpu", "--profile", str(profile), "--out", str(plan_path))
            plan = load_plan(plan_path)
            port, procs = free_port(), []
            for rank in range(2):
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
                env["TRANSFORMERS_VERBOSITY"] = "error"
                out = Path(tmp, f"rank{rank}.json")
                command = [sys.executable, __file__, "--worker", str(SETUP_DIR), str(plan_path), str(out)]
                procs.append((subprocess.Popen(command, env=env), out))
            for proc, _ in procs:
                if proc.wait(timeout=1800):
                    raise SystemExit(f"a setup rank failed (exit {proc.returncode})")
            ranks = [json.loads(out.read_text()) for _, out in procs]
            weights_bytes = sum(f.stat().st_size for f in SETUP_DIR.glob("*.safetensors"))
    finally:
        if not keep_dir:
            shutil.rmtree(SETUP_DIR, ignore_errors=True)
    num_params = plan.model.num_params
    return {
        "model": SETUP_MODEL,
        "num_params": num_params,
        "weights_file_bytes": weights_bytes,
        "bound_bytes": num_params * 4 // 2 + GIB,
        "plan": {
            "chunk_size": plan.memory.chunk_size,
            "chunks": len(plan.memory.chunks),
            "cache_blocks": plan.memory.cache_blocks,
            "offloaded": sum(c.offload for c in plan.memory.chunks),
            "staging_buffers": plan.memory.staging_buffers,
            "micro_batch_size": plan.training.micro_batch_size,
        },
        "ranks": ranks,
    }


def shapes_markdown(report: dict) -> list[str]:
    low, high = RATIO_RANGE
    rows = report["shape_rows"]
    lines = [
        "## Predicted against measured peak per rank, three GPT-2 shapes the tests never had",
        "",
        "Pins: 2 cache blocks, micro-batch 4, fp32, no checkpointing, the search's chunk size and prefetch, the "
        "offload share below; world 2 on the `cpu` preset. Measured: live tensor storages at the step's start "
        "plus the step's allocation peak (tests/distributed/memory_probe.py). Predicted: the plan's device peak "
        "plus this rank's share of the node's host peak (one pool on a CPU device).",
        "",
        "| shape | config | offload | rank | chunks / cache / prefetch | measured MiB | predicted MiB | measured / predicted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        shape = report["shapes"][row["shape"]]
        config = (
            f"hidden {shape['n_embd']}, {shape['n_layer']} layers, vocab {shape['vocab_size']}, seq {shape['seq_len']}"
        )
        plan = row["plan"]
        lines.append(
            f"| {row['shape']} | {config} | {row['offload']} | {row['rank']} | {plan['chunks']} / "
            f"{plan['cache_blocks']} / {plan['prefetch']} | {row['measured_bytes'] / MIB:.1f} | "
            f"{row['predicted_bytes'] / MIB:.1f} | {row['ratio']:.3f} |"
        )
    ratios = [row["ratio"] for row in rows]
    inside = all(low <= r <= high for r in ratios)
    over = [row for row in rows if row["measured_bytes"] > row["predicted_bytes"]]
    lines += [
        "",
        f"Measured / predicted from {min(ratios):.3f} to {max(ratios):.3f}: "
        + (f"every row inside {low}-{high}." if inside else f"NOT every row inside {low}-{high}."),
    ]
    if over:
        worst = max(row["measured_bytes"] - row["predicted_bytes"] for row in over)
        lines.append(
            f"{len(over)} rows measured above their prediction, by up to {worst / MIB:.2f} MiB "
            f"({', '.join(sorted({row['shape'] for row in over}))}; see the notes)."
        )
    return lines + [""]


def setup_markdown(setup: dict) -> list[str]:
    bound = setup["bound_bytes"]
    plan = setup["plan"]
    lines = [
        f"## Setup of {setup['model']} from a Hugging Face directory, the search's plan, world 2",
        "",
        f"{setup['num_params']:,} parameters, weights file {setup['weights_file_bytes'] / GIB:.2f} GiB "
        "(`save_pretrained` of a config-built random model, under /tmp, deleted afterwards). Plan: "
        f"`elixir-tune search --gpus 2 --hardware cpu` on `elixir-tune profile DIR`: {plan['chunks']} chunks of "
        f"{plan['chunk_size']:,} elements, {plan['cache_blocks']} cached, {plan['offloaded']} offloaded, "
        f"{plan['staging_buffers']} staging buffers. Each rank builds the model on the meta device and calls "
        "`elixir_tune.setup(model, optimizer, plan=plan, weights=DIR)` as the fine-tuning recipe does. Peak: "
        "`ru_maxrss` after setup (the whole process). Bound: half the fp32 model + 1 GiB.",
        "",
        "| rank | peak RSS GiB | bound GiB | RSS at start GiB | master shard GiB | setup s |",
        "|---|---|---|---|---|---|",
    ]
    for rank in setup["ranks"]:
        lines.append(
            f"| {rank['rank']} | {rank['peak_rss_bytes'] / GIB:.2f} | {bound / GIB:.2f} | "
            f"{rank['rss_start_bytes'] / GIB:.2f} | {rank['master_shard_bytes'] / GIB:.2f} | {rank['setup_s']} |"
        )
    worst = max(rank["peak_rss_bytes"] for rank in setup["ranks"])
    lines += [
        "",
        f"Worst rank {worst / GIB:.2f} GiB: " + ("under the bound." if worst <= bound else "OVER the bound."),
        "",
    ]
    return lines


def with_generated(report: dict) -> dict:
    """``report`` with the shared header (scripts/report_meta.py) made from the run's own records."""
    keys = ("date", "machine", "commit", "load_before", "load_after")
    return {
        **report,
        "generated": {key: report[key] for key in keys} | {"command": "python scripts/bench_memory_cpu.py"},
    }


def write_markdown(report: dict, path: Path) -> None:
    lines = [
        "# CPU memory: predictions on unseen GPT-2 shapes, and setup from a directory",
        "",
        f"Command: `python scripts/bench_memory_cpu.py`; {report['date']}; {report['machine']}; commit "
        f"{report['commit']}; load average {report['load_before']:.2f} before, {report['load_after']:.2f} after "
        "(other work shared the machine: setup seconds are loaded timings; memory figures do not depend on load).",
        "",
    ]
    if "shape_rows" in report:
        lines += shapes_markdown(report)
    if "setup" in report:
        lines += setup_markdown(report["setup"])
    lines += NOTES
    path.write_text("\n".join(lines) + "\n")


NOTES = [
    "## What changed the figures",
    "",
    "- **Gradients in flight were counted twice.** The profile's activation line comes from a meter that counts "
    "every gradient autograd allocates, from its allocation until the parameter's post-accumulate hook drops it, "
    "as the engine takes it. The memory model still added twice the largest parameter at fp32 beside the line. "
    "Measured, each step's peak above its start was the line to the MiB: the gradients sit inside it. Before the "
    "change the three shapes read 0.860 (vocabulary 50257: the 12.9M-element tied embedding, 98 MiB counted "
    "twice), 0.973 and 0.896. The term now stays only where the line cannot see it: a low-precision gradient "
    "kernel's fp32 workspace, and a rank's share of a line (pipeline, tensor, context) where a gradient arrives "
    "whole (`costmodel/memory.py` `unseen_grad_bytes`).",
    "- **Setup zero-filled the gradient staging pool.** On a CPU device `torch.zeros` wrote both 64M-element "
    "fp32 staging buffers (0.48 GiB) at setup. `acquire` zeroes a buffer as it hands it out, so the pool now maps "
    "its pages on demand (`engine/chunks/staging.py`): they become resident at the first backward. Setup of the "
    "774M model peaked at 2.86 GiB per rank before, on the same plan.",
    "- **Not explained: 3 MiB on the wide shape.** gpt2-wide-20m sometimes measures 3.0 MiB above its "
    "prediction: one MLP-width tensor of its micro-batch (4 x 64 x 3072 x 4 bytes) more in the step than the "
    "line holds. It comes on some ranks and runs and not others under the same plan (another run had it on "
    "rank 0 at offload 1 only), so it looks like the timing of a free against an allocation, not a share of "
    "the model. The other rows lie within 256 bytes under their prediction.",
    "",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("shapes", "setup", "all"), default="all")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shape names")
    parser.add_argument("--results", default=str(RESULTS), help="results path without suffix")
    parser.add_argument("--keep-dir", action="store_true", help=f"keep {SETUP_DIR} for the next run")
    parser.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--markdown-only", action="store_true", help="rewrite the .md from the .json")
    args = parser.parse_args()
    if args.markdown_only:
        report = with_generated(json.loads(Path(args.results + ".json").read_text()))
        Path(args.results + ".json").write_text(json.dumps(report, indent=1))
        write_markdown(report, Path(args.results + ".md"))
        return 0
    if args.worker:
        setup_worker(*map(Path, args.worker))
        return 0
    started = time.time()
    load_before = load_average()
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "commit": commit(),
        "load_before": load_before,
    }
    if args.part in ("shapes", "all"):
        report["shapes"] = {name: SHAPES[name] for name in args.shapes.split(",")}
        report["shape_rows"] = run_shapes(args.shapes.split(","))
    if args.part in ("setup", "all"):
        report["setup"] = run_setup(args.keep_dir)
        for rank in report["setup"]["ranks"]:
            print(
                f"setup rank {rank['rank']}: peak RSS {rank['peak_rss_bytes'] / GIB:.2f} GiB, bound "
                f"{report['setup']['bound_bytes'] / GIB:.2f} GiB, {rank}"
            )
    report["load_after"] = load_average()
    report["elapsed_s"] = round(time.time() - started, 1)
    report = with_generated(report)
    Path(args.results + ".json").write_text(json.dumps(report, indent=1))
    write_markdown(report, Path(args.results + ".md"))
    for row in report.get("shape_rows", []):
        print(
            f"{row['shape']} offload {row['offload']} rank {row['rank']}: measured {row['measured_bytes'] / MIB:.1f} MiB, "
            f"predicted {row['predicted_bytes'] / MIB:.1f} MiB ({row['ratio']:.3f}); live {row['live_bytes'] / MIB:.1f} "
            f"step {row['step_peak_bytes'] / MIB:.1f} act {row['predicted_activation_bytes'] / MIB:.1f} "
            f"buf {row['predicted_buffer_bytes'] / MIB:.1f} report {row['engine_report_bytes'] / MIB:.1f} {row['plan']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
