#!/usr/bin/env python
"""Layered against standard gradient accumulation: predicted and measured step time and bytes moved.

    .venv/bin/python scripts/bench_accumulation.py                  # both parts, ~5 min on 2 loaded cores
    .venv/bin/python scripts/bench_accumulation.py --skip-cpu       # only the predicted GPU table

Part 1, CPU, world 2 (gloo, one thread per worker): a transformers GPT-2 (n_embd 256, 4 layers,
4 heads, vocab 1024, seq 64 by default), fp32, AdamW, every chunk offloaded, the smallest cache the
plan allows (a chunk gathered for one micro-batch is evicted before the next one needs it: the case
layered accumulation is for), no checkpointing, micro-batch 2, accumulation 1, 2, 4 and 8, standard
and layered; the global batch of accumulation 8 as one micro-batch of 16 (standard); and
accumulation 4 with every block checkpointed (standard and layered). Each plan comes from the real profiler and search (``--fix`` pins), on the ``cpu``
hardware preset; its prediction is the search's. Measured: median step time of ``--steps`` steps
after ``--warmup`` (``forward_backward`` + ``step`` + ``zero_grad``), and the engine's counters
per step (gathers, uploads, reduce-scatters).

Bytes moved per rank per step, predicted and measured by the same formula: all-gathers and
reduce-scatters move (world-1)/world of a chunk payload each; each upload copies a shard
host->device, each reduction of an offloaded chunk a shard device->host. Predicted counts are the
cost model's (its breakdown divided by the per-chunk times); measured counts are the engine's.

Part 2, predicted only: GPT-2 4B/10B/20B (configs/models, profiled on the meta device, bf16, seq
1024) on 4 x a100-40gb-pcie at global batch 64: the joint search pinned to standard accumulation,
pinned to layered (both data-parallel only), pinned to a modular pipeline of 2 and 4 stages, free
(it picks), and Elixir's rule (``--strategy elixir``, which has neither).

Saves JSON and markdown (default benchmarks/results/accumulation.*).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from report_meta import generated, with_header, write_pair

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORLD = 2
MICRO = 2
ACCUMS = (1, 2, 4, 8)
GPU_MODELS = ("gpt2-4b", "gpt2-10b", "gpt2-20b")
GPU_BATCH = 64
GPU_COUNT = 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=2**18, help="elements per chunk (pinned)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument(
        "--keep-cpu",
        action="store_true",
        help="with --skip-cpu: keep the CPU part (and its load figures) of the existing --out JSON",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "accumulation"))
    return parser.parse_args()


def model_yaml(args, directory: str) -> str:
    import yaml

    path = os.path.join(directory, "bench-gpt2.yaml")
    config = dict(
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        n_positions=args.seq,
        vocab_size=args.vocab,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    with open(path, "w") as f:
        yaml.safe_dump({"name": "bench-gpt2", "architecture": "gpt2", "seq_len": args.seq, "config": config}, f)
    return path


def transfer_counts(model, shape) -> dict[str, float]:
    """The cost model's gathers, uploads, reduce-scatters and copy-downs of one step."""
    breakdown = model.step_time(shape).breakdown
    costs = model.costs(shape.chunk_size)
    return {
        "gathers": breakdown["allgather_s"] / costs.allgather_s,
        "uploads": breakdown["h2d_s"] / costs.h2d_s if costs.h2d_s else 0.0,
        "reduce_scatters": breakdown["reduce_scatter_s"] / costs.reduce_scatter_s,
        "copy_downs": breakdown["d2h_s"] / costs.d2h_s if costs.d2h_s else 0.0,
    }


def bytes_moved(counts: dict[str, float], chunk_bytes: int, world: int) -> int:
    collective = chunk_bytes * (world - 1) / world
    shard = chunk_bytes / world
    return round(
        (counts["gathers"] + counts["reduce_scatters"]) * collective
        + (counts["uploads"] + counts.get("copy_downs", counts["reduce_scatters"])) * shard
    )


def plan_for(profile, hardware, accum: int, mode: str, chunk_size: int, micro: int = MICRO, every: int = 0):
    """The search's plan with everything pinned but the cache, which is pinned to its minimum."""
    from elixir_tune.costmodel.model import CostModel, Shape
    from elixir_tune.search import search

    model = CostModel(profile, hardware, WORLD, dtype="fp32")
    chunk_size = -(-chunk_size // (8 * WORLD)) * 8 * WORLD
    minimum = model.min_cache_blocks(chunk_size, every)
    pins = [
        f"chunk_size={chunk_size}",
        "offload=1.0",
        f"cache_blocks={minimum}",
        "prefetch=0",
        "checkpointing=" + ("none" if every == 0 else "all"),
        f"micro_batch_size={micro}",
        f"accumulation={mode}",
        "pipeline=1",
        "tensor=1",
        "context=1",
    ]
    result = search(
        profile, hardware, WORLD, global_batch_size=micro * accum * WORLD, fixed=pins, loop="forward_backward"
    )
    plan = result.plan
    shape = Shape(
        plan.memory.chunk_size,
        plan.memory.cache_blocks,
        sum(c.offload for c in plan.memory.chunks),
        plan.memory.prefetch,
        every,
        micro,
        accum,
        offloaded=tuple(c.id for c in plan.memory.chunks if c.offload),
        layered=mode == "layered",
    )
    return plan, transfer_counts(model, shape)


def cpu_worker(rank: int, args, source_path: str, plans: list, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import elixir_tune
    from elixir_tune.profiler import load_model_source
    from elixir_tune.profiler.source import quiet_transformers

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    results = []
    for plan in plans:
        with quiet_transformers():
            torch.manual_seed(0)
            model = load_model_source(source_path).build_model()
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
        accum = plan.training.grad_accum_steps
        generator = torch.Generator().manual_seed(rank)
        times, counts = [], []
        for step in range(args.warmup + args.steps):
            micro = []
            for _ in range(accum):
                ids = torch.randint(0, args.vocab, (plan.training.micro_batch_size, args.seq), generator=generator)
                micro.append({"input_ids": ids, "labels": ids})
            before = model.engine.memory_stats()
            started = time.perf_counter()
            model.forward_backward(micro)
            optimizer.step()
            optimizer.zero_grad()
            elapsed = time.perf_counter() - started
            after = model.engine.memory_stats()
            if step >= args.warmup:
                times.append(elapsed)
                counts.append({k: after[k] - before[k] for k in ("gathers", "uploads", "reduce_scatters")})
        results.append({"step_s": statistics.median(times), "counts": counts[-1], "times": times})
        del model, optimizer
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def cpu_part(args) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    from elixir_tune.hardware import load_hardware
    from elixir_tune.profiler import load_model_source, profile_model

    hardware = load_hardware("cpu")
    rows, plans = [], []
    with tempfile.TemporaryDirectory() as tmp:
        source_path = model_yaml(args, tmp)
        profile = profile_model(load_model_source(source_path), batch_size=MICRO, seq_len=args.seq, dtype="fp32")
        for accum in ACCUMS:
            for mode in ("standard", "layered") if accum > 1 else ("standard",):  # one micro-batch: the same
                plan, predicted = plan_for(profile, hardware, accum, mode, args.chunk_size)
                plans.append(plan)
                rows.append({"accum": accum, "mode": mode, "predicted": predicted, "plan": plan})
        # The same global batch as accumulation 8 in one micro-batch of 16: what layered accumulation
        # costs in activation memory, and the traffic it gets down to.
        plan, predicted = plan_for(profile, hardware, 1, "standard", args.chunk_size, micro=MICRO * ACCUMS[-1])
        plans.append(plan)
        rows.append({"accum": 1, "mode": f"standard, micro {MICRO * ACCUMS[-1]}", "predicted": predicted, "plan": plan})
        # Every block checkpointed: recomputation runs one micro-batch at a time, so a cache smaller
        # than a block refetches its chunks per micro-batch; the cost model does not count that.
        for mode in ("standard", "layered"):
            plan, predicted = plan_for(profile, hardware, 4, mode, args.chunk_size, every=1)
            plans.append(plan)
            rows.append({"accum": 4, "mode": f"{mode}, checkpointing all", "predicted": predicted, "plan": plan})
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        out = os.path.join(tmp, "out")
        mp.spawn(cpu_worker, args=(args, source_path, plans, port, out), nprocs=WORLD, join=True)
        measured = json.loads(Path(f"{out}.rank0.json").read_text())
    table = []
    for row, got in zip(rows, measured, strict=True):
        plan = row["plan"]
        chunk_bytes = plan.memory.chunk_size * 4
        table.append(
            {
                "accum": row["accum"],
                "mode": row["mode"],
                "chunks": len(plan.memory.chunks),
                "cache_blocks": plan.memory.cache_blocks,
                "predicted_step_s": plan.prediction.step_time_s,
                "measured_step_s": got["step_s"],
                "predicted_counts": {k: round(v, 2) for k, v in row["predicted"].items()},
                "measured_counts": got["counts"],
                "predicted_bytes": bytes_moved(row["predicted"], chunk_bytes, WORLD),
                "measured_bytes": bytes_moved(got["counts"], chunk_bytes, WORLD),
                "measured_times_s": got["times"],
            }
        )
    return table


def gpu_part() -> list[dict]:
    from elixir_tune import paths
    from elixir_tune.hardware import load_hardware
    from elixir_tune.profiler import profile_model
    from elixir_tune.search import search

    hardware = load_hardware("a100-40gb-pcie")
    rows = []
    for name in GPU_MODELS:
        profile = profile_model(str(paths.MODEL_CONFIGS_DIR / f"{name}.yaml"), batch_size=8, seq_len=1024, dtype="bf16")
        data_only = ["pipeline=1", "tensor=1", "context=1"]
        runs = {
            "standard": dict(fixed=["accumulation=standard", *data_only]),
            "layered": dict(fixed=["accumulation=layered", *data_only]),
            "pipeline 2": dict(fixed=["pipeline=2", "tensor=1"]),
            "pipeline 4": dict(fixed=["pipeline=4", "tensor=1"]),
            "joint": dict(),
            "elixir rule": dict(strategy="elixir"),
        }
        for label, kwargs in runs.items():
            try:
                result = search(
                    profile, hardware, GPU_COUNT, global_batch_size=GPU_BATCH, **kwargs, loop="forward_backward"
                )
            except ValueError as error:  # e.g. infeasible
                rows.append({"model": name, "search": label, "error": str(error)[:200]})
                continue
            best = result.candidates[0]
            s = best.shape
            rows.append(
                {
                    "model": name,
                    "search": label,
                    "layout": best.layout.describe(),
                    "bubble_s": round(best.estimate.breakdown.get("pipeline_bubble_s", 0.0), 4),
                    "step_s": round(best.step_time_s, 4),
                    "tflops_per_gpu": round(best.tflops_per_gpu, 1),
                    "micro_x_accum": f"{s.micro_batch_size}x{s.grad_accum_steps}",
                    "accumulation": s.accumulation,
                    "offload": round(best.offload_share, 3),
                    "cache": f"{s.cache_blocks}/{best.num_cacheable}",
                    "checkpointing": s.every,
                    "peak_gpu_gib": round(best.memory.peak_gpu_bytes / 2**30, 2),
                }
            )
    return rows


def markdown(record: dict) -> str:
    lines = ["# Layered vs standard gradient accumulation", ""]
    lines.append(
        f"Machine: {record['machine']}; load average before {record['load_before']}, after {record['load_after']}."
    )
    lines.append("Reproduce: `.venv/bin/python scripts/bench_accumulation.py` (see its docstring).")
    if record.get("cpu_kept"):
        lines.append(record["cpu_kept"] + " (`.venv/bin/python scripts/bench_accumulation.py --skip-cpu --keep-cpu`).")
    if record.get("cpu"):
        lines += [
            "",
            "## CPU, world 2, offload all, smallest cache, fp32, micro-batch 2",
            "",
            "| accum | mode | chunks | cache | predicted step s | measured step s | gathers pred / meas | "
            "uploads pred / meas | reduce-scatters pred / meas | MiB moved pred / meas |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in record["cpu"]:
            p, m = r["predicted_counts"], r["measured_counts"]
            lines.append(
                f"| {r['accum']} | {r['mode']} | {r['chunks']} | {r['cache_blocks']} | {r['predicted_step_s']:.3f} | "
                f"{r['measured_step_s']:.3f} | {p['gathers']:g} / {m['gathers']} | {p['uploads']:g} / {m['uploads']} | "
                f"{p['reduce_scatters']:g} / {m['reduce_scatters']} | {r['predicted_bytes'] / 2**20:.1f} / "
                f"{r['measured_bytes'] / 2**20:.1f} |"
            )
    lines += [
        "",
        f"## Predicted, {GPU_COUNT} x a100-40gb-pcie, global batch {GPU_BATCH}, bf16, seq 1024",
        "",
        "standard and layered are pinned to data parallelism only (`--fix pipeline=1 --fix tensor=1`); pipeline P "
        "is `--fix pipeline=P --fix tensor=1` (modular stages, looped breadth-first: layered by construction); "
        "joint is free (GPT-2's vocabulary of 50257 does not split for tensor parallelism, so it can pick a pipeline "
        "but no tensor degree); the Elixir rule has neither.",
        "",
        "| model | search | layout | step s | bubble s | TFLOPS/GPU | micro x accum | accumulation | offload | cache | "
        "ckpt | GPU GiB |",
        "|---|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in record["gpu"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['search']} | | {r['error']} | | | | | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['search']} | {r.get('layout', 'dp only')} | {r['step_s']} | {r.get('bubble_s', 0)} | "
            f"{r['tflops_per_gpu']} | {r['micro_x_accum']} | {r['accumulation']} | {r['offload']:.0%} | {r['cache']} | "
            f"{r['checkpointing']} | {r['peak_gpu_gib']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    record: dict = {
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_before": round(os.getloadavg()[0], 2),
        "args": vars(args),
    }
    if not args.skip_cpu:
        record["cpu"] = cpu_part(args)
    elif args.keep_cpu and Path(args.out).with_suffix(".json").is_file():
        previous = json.loads(Path(args.out).with_suffix(".json").read_text())
        if previous.get("cpu"):
            record["cpu"] = previous["cpu"]
            # Kept twice: the note of the run that measured it still holds.
            record["cpu_kept"] = previous.get("cpu_kept") or (
                f"CPU part kept from the previous run ({previous.get('machine')}, load "
                f"{previous.get('load_before')} -> {previous.get('load_after')}); only the predicted table is new"
            )
    record["gpu"] = gpu_part()
    record["load_after"] = round(os.getloadavg()[0], 2)
    record["generated"] = generated(
        record["load_before"], " ".join(["python scripts/bench_accumulation.py"] + sys.argv[1:])
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = with_header(markdown(record), record["generated"])
    write_pair(out, record, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
