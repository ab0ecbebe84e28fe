#!/usr/bin/env python
"""Step time of the chunk engine against plain PyTorch (1 process) and torch DDP (2 gloo processes), CPU.

    python scripts/bench_engine.py                      # both comparisons, default model
    python scripts/bench_engine.py --steps 6 --layers 4 --out benchmarks/results/engine-cpu.json
    python scripts/bench_engine.py --device cuda --hardware h100-80gb-sxm --fix offload=0.5   # a lent GPU

Model: transformers GPT-2 (n_embd 512, 6 layers, 8 heads, vocab 16384, seq 128: 27M parameters by
default), fp32, AdamW; engine plan: 1M-element chunks, every chunk cached, no offload, no
checkpointing, no prefetch (what a plan for a model that fits looks like). A step is forward +
backward + optimizer step + zero_grad; baseline and engine steps alternate (the same load hits
both); figures are the median and the minimum over ``--steps`` timed steps after ``--warmup``
steps. Prints and saves JSON. ``--device cuda`` measures a searched plan on one GPU against its
prediction instead (see scripts/bench_engine_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from report_meta import generated, load_average, with_header, write_pair  # noqa: E402


def gpt2_config(args) -> dict:
    """The benchmark model's GPT2Config fields (no dropout)."""
    return dict(
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        vocab_size=args.vocab,
        n_positions=args.seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def build_model(args):
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**gpt2_config(args)))


def make_plan(model, world: int, chunk_size: int, prefetch: int = 0):
    from elixir_tune.engine import model_fingerprint
    from elixir_tune.plan import ChunkPlan, ClusterInfo, MemoryPlan, ModelInfo, Plan, TrainingInfo
    from elixir_tune.plan.memory import align_up, chunk_size_multiple, padded_offsets

    multiple = chunk_size_multiple(world)
    chunk_size = max([align_up(chunk_size, multiple)] + [align_up(p.numel(), multiple) for p in model.parameters()])
    chunks, used = [[]], 0
    for name, param in model.named_parameters():
        if align_up(used) + param.numel() > chunk_size and chunks[-1]:
            chunks.append([])
            used = 0
        chunks[-1].append((name, param.numel()))
        used = align_up(used) + param.numel()
    return Plan(
        model=ModelInfo(
            source="bench", fingerprint=model_fingerprint(model), num_params=sum(p.numel() for p in model.parameters())
        ),
        cluster=ClusterInfo(hardware="cpu", nodes=1, gpus_per_node=world, device="cpu", backend="gloo"),
        training=TrainingInfo(
            dtype="fp32", global_batch_size=world, micro_batch_size=1, grad_accum_steps=1, seq_len=128
        ),
        memory=MemoryPlan(
            chunk_size=chunk_size,
            cache_blocks=len(chunks),
            prefetch=min(prefetch, len(chunks) - 1),
            chunks=[
                ChunkPlan(id=i, params=[n for n, _ in c], numel=padded_offsets([k for _, k in c])[1])
                for i, c in enumerate(chunks)
            ],
        ),
    )


def one_step(model, optimizer, batch, engine: bool) -> float:
    start = time.perf_counter()
    loss = model(**batch).loss
    if engine:
        optimizer.backward(loss)
    else:
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def build_pair(args, baseline: str, rank: int, world: int):
    """(baseline model, optimizer), (engine model, optimizer), batch; same weights and data."""
    import torch

    import elixir_tune

    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    batch = {"input_ids": ids, "labels": ids}
    model = build_model(args)
    if baseline == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    base = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    model = build_model(args)
    plan = make_plan(model, world, args.chunk_size, args.prefetch)
    engine = elixir_tune.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), plan=plan)
    return base, engine, batch


def alternate(args, baseline: str, rank: int, world: int) -> dict[str, list[float]]:
    """Times baseline and engine steps alternately, so that load from other processes hits both alike."""
    base, engine, batch = build_pair(args, baseline, rank, world)
    times: dict[str, list[float]] = {baseline: [], "engine": []}
    for step in range(args.warmup + args.steps):
        t_base = one_step(*base, batch, engine=False)
        t_engine = one_step(*engine, batch, engine=True)
        if step >= args.warmup:
            times[baseline].append(t_base)
            times["engine"].append(t_engine)
    return times


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(args.threads_per_rank)
    dist.init_process_group("gloo")
    results = alternate(args, "ddp", rank, world)
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def launch_world2(args) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "w2.json"))
        argv = [sys.executable, __file__, "--worker", "--worker-out", out] + args.passthrough
        procs = [
            subprocess.Popen(
                argv,
                env=dict(
                    os.environ,
                    RANK=str(r),
                    LOCAL_RANK=str(r),
                    WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    OMP_NUM_THREADS=str(args.threads_per_rank),
                    PYTHONWARNINGS="ignore",
                ),
            )
            for r in range(2)
        ]
        for proc in procs:
            if proc.wait(timeout=1800):
                raise SystemExit(f"world-2 worker failed with exit status {proc.returncode}")
        return json.loads(Path(out).read_text())


def summarise(times: dict[str, list[float]], baseline: str) -> dict:
    median = {mode: statistics.median(t) for mode, t in times.items()}
    best = {mode: min(t) for mode, t in times.items()}
    return {
        "median_step_time_s": median,
        "min_step_time_s": best,
        "all_step_times_s": times,
        f"ratio_engine_vs_{baseline}_median": median["engine"] / median[baseline],
        f"ratio_engine_vs_{baseline}_min": best["engine"] / best[baseline],
    }


def markdown(result: dict) -> str:
    """The CPU report: engine against plain PyTorch (world 1) and DDP (world 2), seconds per step."""
    m = result["model"]
    lines = [
        "# Engine step time against plain PyTorch and DDP, CPU",
        "",
        f"Model: transformers GPT-2, n_embd {m['hidden']}, {m['layers']} layers, {m['heads']} heads, vocab "
        f"{m['vocab']}, seq {m['seq']}, {m['batch']} samples per rank ({result['num_params']:,} parameters), fp32, "
        f"AdamW; torch {result['torch']} on {result['cores']} cores. A step: forward, backward, optimizer step, "
        f"zero_grad; baseline and engine steps alternate; {result['steps']} timed steps after {result['warmup']} "
        "warm-up steps.",
        "",
        "| world | baseline | baseline s (median) | engine s (median) | engine / baseline (median) | "
        "baseline s (min) | engine s (min) | engine / baseline (min) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for world, baseline in (("world1", "torch"), ("world2", "ddp")):
        w = result.get(world)
        if not w:
            continue
        median, least = w["median_step_time_s"], w["min_step_time_s"]
        lines.append(
            f"| {world[-1]} | {'plain PyTorch' if baseline == 'torch' else 'DDP (gloo)'} | {median[baseline]:.3f} | "
            f"{median['engine']:.3f} | {w[f'ratio_engine_vs_{baseline}_median']:.3f} | {least[baseline]:.3f} | "
            f"{least['engine']:.3f} | {w[f'ratio_engine_vs_{baseline}_min']:.3f} |"
        )
    lines += ["", "Every step's time is in the JSON (`all_step_times_s`)."]
    return with_header("\n".join(lines) + "\n", result["generated"])


def gpu_markdown(result: dict) -> str:
    """The GPU report: a searched plan on one GPU against its prediction."""
    lines = [
        f"# Engine on {result.get('device', 'a GPU')}: measured against predicted",
        "",
        f"Step time {result['step_time_s']['median']:.4f} s (median; predicted {result['predicted_step_time_s']:.4f} s); "
        f"peak allocated {result['peak_allocated_bytes'] / 2**30:.2f} GiB (predicted "
        f"{result['predicted_peak_gpu_bytes'] / 2**30:.2f} GiB). Command: `{result.get('command', '')}`.",
    ]
    return with_header("\n".join(lines) + "\n", result["generated"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    parser.add_argument("--chunk-size", type=int, default=1 << 20, help="elements per chunk")
    parser.add_argument("--prefetch", type=int, default=0, help="plan's memory.prefetch")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, world 1")
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--skip-world2", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the GPU mode")
    parser.add_argument("--hardware", default="h100-80gb-sxm", help="GPU mode: preset or hardware YAML to search for")
    parser.add_argument("--fix", action="append", default=[], help="GPU mode: search pin KEY=VALUE (repeatable)")
    parser.add_argument("--dtype", default="bf16", help="GPU mode: compute dtype")
    parser.add_argument("--accum", type=int, default=1, help="GPU mode: micro-batches per step")
    parser.add_argument(
        "--out", default=None, help="report: PREFIX.json and PREFIX.md (default benchmarks/results/engine-<device>)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.passthrough = [
        f"--{k}={getattr(args, k.replace('-', '_'))}"
        for k in (
            "hidden",
            "layers",
            "heads",
            "vocab",
            "seq",
            "batch",
            "chunk-size",
            "prefetch",
            "steps",
            "warmup",
            "threads-per-rank",
        )
    ]
    if args.worker:
        worker(args)
        return
    args.out = str(Path(args.out or REPO / "benchmarks" / "results" / f"engine-{args.device}").with_suffix(""))
    load_before = load_average()
    if args.device == "cuda":
        from bench_engine_gpu import run_gpu

        result = dict(run_gpu(args, gpt2_config(args)), command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]))
        print(
            f"{result['device']}: {result['step_time_s']['median'] * 1e3:.1f} ms/step (predicted "
            f"{result['predicted_step_time_s'] * 1e3:.1f}), peak {result['peak_allocated_bytes'] / 2**30:.2f} GiB "
            f"allocated (predicted {result['predicted_peak_gpu_bytes'] / 2**30:.2f})"
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        result["generated"] = generated(load_before)
        write_pair(Path(args.out), result, gpu_markdown(result))
        print(f"saved {args.out}.json and .md")
        return

    import torch

    torch.set_num_threads(args.threads)
    result = {
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "load_before": os.getloadavg(),
        "model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "vocab", "seq", "batch")},
        "num_params": sum(p.numel() for p in build_model(args).parameters()),
        "steps": args.steps,
        "warmup": args.warmup,
    }
    result["world1"] = dict(summarise(alternate(args, "torch", 0, 1), "torch"), threads=args.threads)
    w1 = result["world1"]
    print(
        f"world 1: torch {w1['median_step_time_s']['torch'] * 1e3:.1f} ms/step, engine "
        f"{w1['median_step_time_s']['engine'] * 1e3:.1f} ms/step (medians); engine/torch "
        f"{w1['ratio_engine_vs_torch_median']:.3f} (median), {w1['ratio_engine_vs_torch_min']:.3f} (min)"
    )
    if not args.skip_world2:
        result["world2"] = dict(summarise(launch_world2(args), "ddp"), threads_per_rank=args.threads_per_rank)
        w2 = result["world2"]
        print(
            f"world 2 (gloo): ddp {w2['median_step_time_s']['ddp'] * 1e3:.1f} ms/step, engine "
            f"{w2['median_step_time_s']['engine'] * 1e3:.1f} ms/step (medians); engine/ddp "
            f"{w2['ratio_engine_vs_ddp_median']:.3f} (median), {w2['ratio_engine_vs_ddp_min']:.3f} (min)"
        )
    result["load_after"] = os.getloadavg()
    result["generated"] = generated(load_before)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_pair(Path(args.out), result, markdown(result))
    print(f"saved {args.out}.json and .md")


if __name__ == "__main__":
    main()
