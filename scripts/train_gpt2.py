"""Train a GPT-2 (or any causal LM a plan names) with elixir-tune, on a bundled public-domain text.

Run it under elixir-run, which starts one process per GPU (or CPU worker) as the plan says and
tells each one where the plan is ($ELIXIR_TUNE_PLAN):

    elixir-run plan.yaml scripts/train_gpt2.py --steps 200 --log runs/train.json
    elixir-run plan.yaml scripts/train_gpt2.py --synthetic --steps 20      # random tokens, for speed
    elixir-run plan.yaml scripts/train_gpt2.py --steps 200 --save ckpt --save-every 50
    elixir-run plan.yaml scripts/train_gpt2.py --steps 200 --resume ckpt --save ckpt   # continues exactly

Data: the bytes of a text file are the tokens (vocabulary 256, nothing to download); every step
draws a global batch of random windows, the same on every rank, and each rank trains on its own
slice of it. Batching comes from the plan: global batch = micro-batch x accumulation x world size.
Rank 0 shows a progress bar (loss, tokens/s, TFLOPS, memory) and writes a JSON log of every step.
Checkpoints (--save) are sharded (elixir_tune.save_checkpoint); with --save, Ctrl-C or SIGTERM
finishes the current step on every rank, saves, and exits 130. --resume continues at the saved step:
the data and the LR schedule (a function of the step and --steps) go on exactly as if never stopped.
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

# transformers' notices (e.g. about the default loss) would repeat once per rank; errors still show.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record  # noqa: E402

import elixir_tune  # noqa: E402
from elixir_tune.profiler import load_model_source  # noqa: E402

REPO_DIR = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_DIR / "data" / "public_domain.txt"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--synthetic", action="store_true", help="random tokens instead of the text")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="text file; its bytes are the tokens")
    parser.add_argument("--log", default="runs/train.json", help="JSON log of every step (rank 0)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up (default: steps / 10)")
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights (same on every rank) and the data")
    parser.add_argument("--model", default=None, help="model spec (default: the plan's model.source)")
    parser.add_argument("--print-every", type=int, default=None, help="print a line every N steps (default: ~20 lines)")
    parser.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="checkpoint directory: saved at the end, every --save-every steps and on SIGINT/SIGTERM",
    )
    parser.add_argument("--save-every", type=int, default=0, metavar="N", help="also save every N steps (0: never)")
    parser.add_argument("--resume", default=None, metavar="DIR", help="continue from this checkpoint's step")
    parser.add_argument(
        "--stop-at",
        type=int,
        default=None,
        metavar="N",
        help="stop after N steps, keeping the --steps schedule (as an interrupted run would)",
    )
    return parser.parse_args()


class WindowSampler:
    """Random windows of ``seq_len`` tokens; the global batch of a step depends only on the seed and
    the step, so every rank draws the same one and takes its own slice."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int):
        if tokens.numel() <= seq_len:
            raise SystemExit(f"the data has {tokens.numel()} tokens, fewer than seq_len {seq_len} + 1")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed

    def global_batch(self, step: int, size: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (size,), generator=generator)
        return torch.stack([self.tokens[start : start + self.seq_len] for start in starts.tolist()])


class SyntheticSampler:
    """Uniformly random tokens (for throughput runs; the loss stays near ln(vocab))."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def global_batch(self, step: int, size: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.vocab_size, (size, self.seq_len), generator=generator)


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


@record  # an unexpected error reaches elixir-run's failure report, not only this rank's output
def main() -> int:
    args = parse_args()
    plan_path = os.environ.get(elixir_tune.plan.PLAN_ENV_VAR, "")
    plan = elixir_tune.load_plan()  # $ELIXIR_TUNE_PLAN, set by elixir-run
    training = plan.training
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if plan.cluster.device == "cuda"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    source = load_model_source(resolve_model_spec(args.model or plan.model.source, plan_path))
    model = source.build_model()
    num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    vocab_size = source.vocab_size or getattr(getattr(model, "config", None), "vocab_size", None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    try:
        model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
    except ValueError as error:  # the plan does not fit this model (fingerprint, parameters, memory)
        if os.environ.get("RANK", "0") == "0":
            print(f"error: elixir_tune.setup refused the plan: {error}", file=sys.stderr, flush=True)
        ErrorHandler().record_exception(error)  # elixir-run's failure report quotes it
        return 1

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != plan.world_size:
        raise SystemExit(
            f"the plan is for {plan.world_size} processes but this job has {world}; start it with elixir-run"
        )

    if args.synthetic:
        if not vocab_size:
            raise SystemExit("--synthetic needs the model's vocabulary size (model.config.vocab_size)")
        sampler = SyntheticSampler(vocab_size, training.seq_len, args.seed)
        data_name = "synthetic"
    else:
        if vocab_size is not None and vocab_size < 256:
            raise SystemExit(
                f"byte-level text needs a vocabulary of at least 256, the model has {vocab_size}; use --synthetic"
            )
        data = Path(args.data)
        tokens = torch.frombuffer(bytearray(data.read_bytes()), dtype=torch.uint8).long()
        sampler = WindowSampler(tokens, training.seq_len, args.seed)
        data_name = str(data)

    start_step = 0
    if args.resume:
        meta = elixir_tune.load_checkpoint(args.resume, model, optimizer)
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
    tokens_per_step = training.global_batch_size * training.seq_len
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10)
    header = {
        "script": "train_gpt2.py",
        "plan": plan_path,
        "model": source.name,
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
            f"training {source.name} ({num_params:,} params) on {world} {plan.cluster.device} worker(s): "
            f"{args.steps} steps of {training.global_batch_size} x {training.seq_len} tokens "
            f"(micro-batch {micro} x accumulation {accum} x world {world}), data: {data_name}",
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
        elixir_tune.save_checkpoint(args.save, model, optimizer, step=steps_done, extra=checkpoint_extra)
        if reporter:
            reporter.progress.console.print(f"saved checkpoint {args.save} at step {steps_done}")

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
                batch = sampler.global_batch(step, training.global_batch_size)[rank * per_rank : (rank + 1) * per_rank]
                loss_sum = torch.zeros((), device=device)
                for index in range(accum):
                    input_ids = batch[index * micro : (index + 1) * micro].to(device, non_blocking=True)
                    output = model(input_ids=input_ids, labels=input_ids)
                    loss = output.loss if hasattr(output, "loss") else output
                    optimizer.backward(loss / accum)
                    loss_sum += loss.detach().float()
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
    except KeyboardInterrupt:
        if reporter:
            reporter.write(status="interrupted")
            reporter.console.print(f"interrupted at step {step}; log so far: {reporter.log_path}")
            if args.save and (Path(args.save) / "meta.json").exists():
                reporter.console.print(f"continue with --resume {args.save} (same --steps, --seed and --lr)")
        return 130
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
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
