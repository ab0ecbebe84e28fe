"""What the peer workers share: arguments, the model, synthetic batches, the timed loop, the record.

A peer worker trains the same GPT-2 (a model YAML, built with transformers from its config, never
downloaded), with the same micro-batch, accumulation, sequence length and checkpointing as one of
our plans, under another system (FSDP2, DeepSpeed), and writes one JSON record from rank 0:
step times, peak device memory (allocated and reserved, the largest over ranks), peak host RSS.
Started under torchrun (one process per GPU, or gloo CPU workers in a dry run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True, help="model YAML (configs/models format)")
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--grad-accum-steps", type=int, default=1)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--checkpointing", choices=["none", "all"], default="none")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the median")
    parser.add_argument("--out", required=True, help="JSON record (rank 0)")
    return parser.parse_args()


def init_distributed() -> tuple[torch.device, int, int]:
    """Process group (nccl with CUDA, else gloo) and this rank's device."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return device, dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def fast_init():
    """Weights filled with a constant instead of drawn at random, while building a model.

    A 5B-parameter model's random init takes about a minute on the CPU (torch's normal_ is serial),
    longer than a few timed steps; step time and memory do not depend on the values. Used when
    $VALIDATE_FAST_INIT is 1 (gpu_validate sets it on GPUs); the loss is then not a real loss.
    """
    if os.environ.get("VALIDATE_FAST_INIT") != "1":
        yield
        return

    def fill(tensor, *args, **kwargs):
        with torch.no_grad():
            return tensor.fill_(0.02)

    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "xavier_uniform_")
    saved_init = {name: getattr(torch.nn.init, name) for name in names}
    saved_tensor = {name: getattr(torch.Tensor, name) for name in ("normal_", "uniform_")}
    try:
        for name in names:
            setattr(torch.nn.init, name, fill)
        for name in saved_tensor:
            setattr(torch.Tensor, name, fill)
        yield
    finally:
        for name, function in saved_init.items():
            setattr(torch.nn.init, name, function)
        for name, function in saved_tensor.items():
            setattr(torch.Tensor, name, function)


def build_model(model_yaml: str, checkpointing: str) -> torch.nn.Module:
    """The model in fp32 on the CPU, seeded as train_gpt2.py seeds it."""
    from elixir_tune.profiler import load_model_source

    torch.manual_seed(0)
    with fast_init():
        model = load_model_source(model_yaml).build_model()
    if checkpointing == "all":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def batch(step: int, micro: int, seq: int, vocab: int, rank: int, device: torch.device) -> torch.Tensor:
    """Random tokens, different per rank and step (the loss value does not matter here)."""
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randint(0, vocab, (micro, seq), generator=generator).to(device)


def accumulated_step(runner, model, optimizer, args: argparse.Namespace, vocab: int, rank: int, device):
    """One training step of a plain torch loop: accumulate micro-batches, clip at 1.0, step, zero."""

    def step(index: int) -> float:
        total = 0.0
        for micro in range(args.grad_accum_steps):
            ids = batch(index * args.grad_accum_steps + micro, args.micro_batch_size, args.seq_len, vocab, rank, device)
            loss = runner(input_ids=ids, labels=ids).loss / args.grad_accum_steps
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return total

    return step


def timed_steps(step_fn: Callable[[int], float], steps: int, device: torch.device) -> tuple[list[float], list[float]]:
    """Runs ``step_fn(step) -> loss`` ``steps`` times; (step seconds, losses)."""
    times, losses = [], []
    for step in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        started = time.perf_counter()
        loss = step_fn(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
        losses.append(float(loss))
    return times, losses


def peak_memory(device: torch.device) -> dict:
    """This rank's peaks, then the largest over ranks."""
    mine = [
        torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
        torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0,
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    ]
    peaks = torch.tensor(mine, dtype=torch.float64, device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    allocated, reserved, rss = (int(v) for v in peaks.tolist())
    return {"max_memory_allocated_bytes": allocated, "max_memory_reserved_bytes": reserved, "peak_rss_bytes": rss}


def write_record(args: argparse.Namespace, system: str, times: list[float], losses: list[float], extra: dict) -> None:
    """Rank 0 writes the record (every rank must call: the memory peaks are all-reduced)."""
    cuda = torch.cuda.is_available()
    memory = peak_memory(torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
    if dist.get_rank() != 0:
        return
    timed = times[args.warmup :] or times
    record = {
        "system": system,
        "world_size": dist.get_world_size(),
        "micro_batch_size": args.micro_batch_size,
        "grad_accum_steps": args.grad_accum_steps,
        "seq_len": args.seq_len,
        "checkpointing": args.checkpointing,
        "dtype": args.dtype,
        "step_times_s": times,
        "median_step_time_s": statistics.median(timed),
        "losses": losses,
        **memory,
        **extra,
    }
    Path(args.out).write_text(json.dumps(record, indent=1))
