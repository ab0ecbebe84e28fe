"""The training loop that scripts/train_gpt2.py and scripts/finetune.py share.

Everything after the model is set up: resume, the LR schedule, gradient accumulation over the
plan's micro-batches, rank 0's progress bar, printed lines and JSON log, checkpoints (every N
steps, at the end, and on SIGINT/SIGTERM), and the final summary. A sampler gives the global batch
of a step (a dict of tensors: ``input_ids``, ``labels``, optionally ``attention_mask``), the same on
every rank; each rank trains on its own slice of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import elixir_tune
from elixir_tune.engine.io.checkpoint_files import LATEST_NAME, CheckpointError


def add_training_args(parser: argparse.ArgumentParser, lr: float = 3e-3) -> None:
    """The options both scripts take: schedule, logging, checkpoints."""
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--log", default="runs/train.json", help="JSON log of every step (rank 0)")
    parser.add_argument("--lr", type=float, default=lr, help="peak learning rate (AdamW)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up (default: steps / 10)")
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights (same on every rank) and the data")
    parser.add_argument("--print-every", type=int, default=None, help="print a line every N steps (default: ~20 lines)")
    parser.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="checkpoint directory: saved at the end, every --save-every steps and on SIGINT/SIGTERM",
    )
    parser.add_argument("--save-every", type=int, default=0, metavar="N", help="also save every N steps (0: never)")
    parser.add_argument(
        "--keep",
        type=int,
        default=2,
        metavar="N",
        help="keep the newest N checkpoints in --save (DIR/step-NNNNNN, DIR/latest names the newest; 0: all)",
    )
    parser.add_argument(
        "--resume", default=None, metavar="DIR", help="continue from this checkpoint (a --save DIR: its latest)"
    )
    parser.add_argument(
        "--stop-at",
        type=int,
        default=None,
        metavar="N",
        help="stop after N steps, keeping the --steps schedule (as an interrupted run would)",
    )


class WindowSampler:
    """Random windows of ``seq_len`` tokens; the global batch of a step depends only on the seed and
    the step, so every rank draws the same one and takes its own slice."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int):
        if tokens.numel() <= seq_len:
            raise SystemExit(f"the data has {tokens.numel()} tokens, fewer than seq_len {seq_len} + 1")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed

    def global_batch(self, step: int, size: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (size,), generator=generator)
        ids = torch.stack([self.tokens[start : start + self.seq_len] for start in starts.tolist()])
        return {"input_ids": ids, "labels": ids}


class SyntheticSampler:
    """Uniformly random tokens (for throughput runs; the loss stays near ln(vocab))."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def global_batch(self, step: int, size: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        ids = torch.randint(0, self.vocab_size, (size, self.seq_len), generator=generator)
        return {"input_ids": ids, "labels": ids}


def plan_and_device() -> tuple[str, elixir_tune.plan.Plan, torch.device]:
    """The plan elixir-run gave this worker ($ELIXIR_TUNE_PLAN), its path, and the device it runs on
    (the GPU of LOCAL_RANK for a cuda plan, made current; the CPU otherwise)."""
    plan_path = os.environ.get(elixir_tune.plan.PLAN_ENV_VAR, "")
    plan = elixir_tune.load_plan()
    if plan.cluster.device != "cuda":
        return plan_path, plan, torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return plan_path, plan, device


def step_loss(output, batch: dict) -> torch.Tensor:
    """A micro-batch's loss: the model output's ``loss`` (transformers), or the output itself."""
    return output.loss if hasattr(output, "loss") else output


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def memory_bytes(device: torch.device) -> int:
    """Peak device memory on a GPU; resident memory of this process on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resolve_model_spec(spec: str, plan_path: str) -> str:
    """A relative model path is tried from the working directory, then beside the plan."""
    path_part = spec.split(":")[0]
    if Path(path_part).suffix and not Path(path_part).exists():
        beside_plan = Path(plan_path).resolve().parent / path_part
        if beside_plan.exists():
            return str(beside_plan) + spec[len(path_part) :]
    return spec


class Reporter:
    """Rank 0's progress bar, printed lines and JSON log."""

    def __init__(self, args: argparse.Namespace, header: dict):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = Console(highlight=False)
        self.steps = args.steps
        self.print_every = args.print_every or max(1, args.steps // 20)
        self.log_path = Path(args.log) if args.log else None
        self.record = {**header, "steps": []}
        self.progress = Progress(
            TextColumn("[bold]train[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("{task.fields[tflops]} TFLOPS"),
            TextColumn("mem {task.fields[mem]}"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
        )
        self.task = self.progress.add_task("train", total=args.steps, loss="-", tps="-", tflops="-", mem="-")

    def __enter__(self) -> Reporter:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def step(self, entry: dict) -> None:
        self.record["steps"].append(entry)
        self.progress.update(
            self.task,
            advance=1,
            loss=f"{entry['loss']:.3f}",
            tps=f"{entry['tokens_per_s']:,.0f}",
            tflops=f"{entry['tflops_per_gpu']:.4f}",
            mem=f"{entry['memory_bytes'] / 2**20:,.0f} MiB",
        )
        number = entry["step"] + 1
        if number == 1 or number % self.print_every == 0 or number == self.steps:
            self.progress.console.print(
                f"step {number:>5}/{self.steps}  loss {entry['loss']:.4f}  {entry['tokens_per_s']:>9,.0f} tok/s  "
                f"{entry['tflops_per_gpu']:.4f} TFLOPS/worker  {entry['step_time_s'] * 1000:7.1f} ms  "
                f"mem {entry['memory_bytes'] / 2**20:,.0f} MiB  lr {entry['lr']:.2e}",
                soft_wrap=True,
            )
        self.write()

    def write(self, status: str = "running") -> None:
        if not self.log_path:
            return
        steps = self.record["steps"]
        if steps:
            timed = steps[1:] or steps  # the first step includes warm-up work
            self.record["summary"] = {
                "status": status,
                "steps_done": len(steps),
                "first_loss": steps[0]["loss"],
                "last_loss": steps[-1]["loss"],
                "mean_tokens_per_s": sum(s["tokens_per_s"] for s in timed) / len(timed),
                "mean_step_time_s": sum(s["step_time_s"] for s in timed) / len(timed),
                "peak_memory_bytes": max(s["memory_bytes"] for s in steps),
            }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.log_path.with_suffix(self.log_path.suffix + ".tmp")
        partial.write_text(json.dumps(self.record, indent=1))
        partial.replace(self.log_path)  # readers never see a half-written log


def checkpoint_failed(error: CheckpointError, rank: int) -> int:
    """Prints a checkpoint error once (rank 0; every rank has it) and returns the exit status 1."""
    if rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    return 1


def train(
    args: argparse.Namespace,
    model,
    optimizer,
    plan,
    sampler,
    *,
    script: str,
    model_name: str,
    num_params: int,
    data_name: str,
    device: torch.device,
    rank: int,
    world: int,
) -> int:
    """Runs the training steps of ``args`` (resume, schedule, logging, checkpoints).

    Returns:
        0 when the steps are done, 130 when interrupted (after saving with --save), 1 when a step's loss or
        gradient norm was not finite (``NonFiniteError``; nothing is saved after it).
    """
    plan_path = os.environ.get(elixir_tune.plan.PLAN_ENV_VAR, "")
    training = plan.training
    start_step = 0
    if args.keep < 0:
        raise SystemExit(f"--keep must be 0 (keep every checkpoint) or more, not {args.keep}")
    try:  # a second job saving to the same directory is refused before it trains
        if args.save:
            elixir_tune.lock_checkpoint_dir(args.save, model)
        meta = elixir_tune.load_checkpoint(args.resume, model, optimizer) if args.resume else {}
    except CheckpointError as error:  # every rank has the same one-line error
        return checkpoint_failed(error, rank)
    if args.resume:
        start_step = int(meta["step"])
        saved = meta.get("extra", {})
        if rank == 0:
            print(
                f"resumed from {args.resume} at step {start_step}"
                + ("" if meta.get("exact") else " (weights only: optimizer state restarts)"),
                flush=True,
            )
            for key, value in (("steps", args.steps), ("seed", args.seed), ("lr", args.lr)):
                if key in saved and saved[key] != value:
                    print(
                        f"note: the checkpoint was saved with --{key} {saved[key]}, this run uses {value}: "
                        "the data or LR schedule differs from the original run",
                        flush=True,
                    )
    stop_step = min(args.steps, args.stop_at) if args.stop_at is not None else args.steps

    micro, accum = training.micro_batch_size, training.grad_accum_steps
    per_rank = micro * accum
    # Each data-parallel index trains on its slice; the ranks of one pipeline (or tensor) group share it.
    data_rank = elixir_tune.data_rank()
    tokens_per_step = training.global_batch_size * training.seq_len
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10)
    header = {
        "script": script,
        "plan": plan_path,
        "model": model_name,
        "num_params": num_params,
        "world_size": world,
        "device": plan.cluster.device,
        "dtype": training.dtype,
        "global_batch_size": training.global_batch_size,
        "micro_batch_size": micro,
        "grad_accum_steps": accum,
        "seq_len": training.seq_len,
        "data": data_name,
        "lr": args.lr,
        "seed": args.seed,
        "predicted_step_time_s": plan.prediction.step_time_s if plan.prediction else None,
    }
    if args.resume:
        header["resumed_from"] = {"checkpoint": args.resume, "step": start_step}
    reporter = Reporter(args, header) if rank == 0 else None
    if reporter and start_step:
        reporter.progress.update(reporter.task, completed=start_step)
    if reporter:
        reporter.console.print(
            f"training {model_name} ({num_params:,} params) on {world} {plan.cluster.device} worker(s): "
            f"{args.steps} steps of {training.global_batch_size} x {training.seq_len} tokens "
            f"(micro-batch {micro} x accumulation {accum} x data-parallel {plan.data_parallel_size}"
            + (f"; {world} workers" if plan.data_parallel_size != world else "")
            + f"), data: {data_name}",
            soft_wrap=True,
        )

    checkpoint_extra = {
        "steps": args.steps,
        "seed": args.seed,
        "lr": args.lr,
        "warmup_steps": warmup,
        "data": data_name,
    }

    def save(steps_done: int) -> None:
        directory = elixir_tune.save_checkpoint(
            args.save, model, optimizer, step=steps_done, extra=checkpoint_extra, keep=args.keep or None
        )
        if reporter:
            reporter.progress.console.print(f"saved checkpoint {directory} at step {steps_done}")

    # With --save, a signal only raises a flag: every rank finishes the step, they agree on the flag
    # (one all-reduce with the loss) and save together; a collective save cannot start mid-step.
    stop_requested = []
    if args.save:

        def request_stop(signum, frame):
            if stop_requested:  # a second signal: stop now, without saving
                raise KeyboardInterrupt
            stop_requested.append(signum)

        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)

    step = start_step
    steps_done = start_step
    try:
        with reporter or contextlib.nullcontext():
            for step in range(start_step, stop_step):
                lr = lr_at(step, args.steps, args.lr, warmup)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                started = time.perf_counter()
                batch = sampler.global_batch(step, training.global_batch_size)
                micro_batches = [
                    {k: v[begin : begin + micro].to(device, non_blocking=True) for k, v in batch.items()}
                    for begin in range(data_rank * per_rank, (data_rank + 1) * per_rank, micro)
                ]
                # All micro-batches as the plan says (standard or layered accumulation); the mean loss.
                loss_sum = model.forward_backward(micro_batches, loss_fn=step_loss).float() * accum
                grad_norm = optimizer.clip_grad_norm(args.clip) if args.clip > 0 else None
                optimizer.step()
                optimizer.zero_grad()
                # The mean loss over all ranks' micro-batches, for the log only.
                if args.save:
                    flagged = torch.stack([loss_sum, torch.tensor(float(bool(stop_requested)), device=device)])
                    if world > 1:
                        dist.all_reduce(flagged)
                    loss_sum, stop_now = flagged[0], bool(flagged[1] > 0)
                else:
                    stop_now = False
                    if world > 1:
                        dist.all_reduce(loss_sum)
                mean_loss = float(loss_sum) / (accum * world)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                step_time_s = time.perf_counter() - started
                if reporter:
                    reporter.step(
                        {
                            "step": step,
                            "loss": mean_loss,
                            "lr": lr,
                            "step_time_s": step_time_s,
                            "grad_norm": float(grad_norm) if grad_norm is not None else None,
                            "tokens": tokens_per_step,
                            "tokens_per_s": tokens_per_step / step_time_s,
                            # model FLOPs: 6 per parameter per token (forward + backward), per worker
                            "tflops_per_gpu": 6 * num_params * tokens_per_step / step_time_s / world / 1e12,
                            "memory_bytes": memory_bytes(device),
                        }
                    )
                steps_done = step + 1
                if stop_now:
                    save(steps_done)
                    raise KeyboardInterrupt
                if args.save and args.save_every and steps_done % args.save_every == 0 and steps_done < stop_step:
                    save(steps_done)
            if args.save and steps_done > start_step:
                save(steps_done)
    except elixir_tune.NonFiniteError as error:  # fp32/bf16: a NaN/inf step; every save refuses after it
        if reporter:
            reporter.write(status="non-finite")
            reporter.console.print(f"[bold red]error[/]: {error}", soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        if reporter:
            reporter.write(status="interrupted")
            reporter.console.print(f"interrupted at step {step}; log so far: {reporter.log_path}")
            if args.save and (Path(args.save) / LATEST_NAME).exists():
                reporter.console.print(f"continue with --resume {args.save} (same --steps, --seed and --lr)")
        return 130
    except CheckpointError as error:  # a refused save (non-finite weights, disk full): the old ones stay
        if reporter:
            reporter.write(status="failed")
        return checkpoint_failed(error, rank)
    if reporter:
        reporter.write(status="finished")
        summary = reporter.record.get("summary", {})
        if summary:
            reporter.console.print(
                f"[bold green]done[/]: loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} over "
                f"{summary['steps_done']} steps, {summary['mean_tokens_per_s']:,.0f} tokens/s, "
                f"{summary['mean_step_time_s'] * 1000:.1f} ms/step"
                + (f"; log: {reporter.log_path}" if reporter.log_path else ""),
                soft_wrap=True,
            )
    return 0
