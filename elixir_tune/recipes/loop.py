"""The training loop every recipe shares.

Everything after the model is set up: the run's length (``--steps``, or ``--epochs`` over the data's samples),
resume, the LR schedule, the plan's micro-batches, evaluation every ``--eval-every`` steps and at the end (with
``--keep-best``), rank 0's reporting (progress.py), checkpoints (every N steps, at the end, and on
SIGINT/SIGTERM), and the final summary. The data (``elixir_tune.data.TrainData``, or pretrain's text_data.py)
gives each data-parallel rank its rows of a step's global batch.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import elixir_tune
from elixir_tune.cli.console import escape
from elixir_tune.cli.progress import Reporter
from elixir_tune.device import ops_for
from elixir_tune.engine.comm import shared_errors
from elixir_tune.engine.io.checkpoint_files import LATEST_NAME, CheckpointError
from elixir_tune.engine.io.pretrained_files import describe_failure
from elixir_tune.engine.model import loss_of
from elixir_tune.engine.peers.common import world_comm
from elixir_tune.recipes.data_identity import data_change, data_record, data_refusal
from elixir_tune.recipes.evaluation import evaluate
from elixir_tune.recipes.fp16_watch import Fp16Watch
from elixir_tune.recipes.restarts import lost_peer_line, restart_count, resume_after_restart
from elixir_tune.recipes.throughput import promise, step_figures, token_counts

BEST_DIR_NAME = "best"  # --keep-best: the best evaluation's checkpoint, a root of its own under --save


def step_loss(output, batch: dict) -> torch.Tensor:
    """A micro-batch's loss: the model output's, as ``forward_backward`` finds it (``loss_of``)."""
    return loss_of(output)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def resident_bytes() -> int:
    """This process's resident memory now."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# What no plan counts, measured once the recipe has built its model: the interpreter, torch, transformers and
# the family's modeling code it imports on the first build (0.4-0.5 GiB; building GPT-2 tiny's 0.5 MB of
# weights grew the process by 118 MiB, nearly all of it that import). On the CPU a step's memory is measured
# above it.
_start_bytes: int | None = None


def mark_process_start(model: torch.nn.Module) -> None:
    """Records the process's memory once ``model`` is built, less the model's own tensors (which the plan
    counts); the recipes call it right after building the model, before ``setup``."""
    global _start_bytes
    tensors = [*model.parameters(), *model.buffers()]
    model_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values() if not t.is_meta)
    _start_bytes = resident_bytes() - model_bytes


def memory_bytes(device: torch.device) -> int:
    """Peak device memory on a GPU; on the CPU the process's resident memory above what no plan counts
    (``mark_process_start``)."""
    peak = ops_for(device).peak_memory_bytes()
    if peak is not None:
        return peak
    return max(0, resident_bytes() - (_start_bytes or 0))


def run_steps(args: argparse.Namespace, data, global_batch_size: int) -> int:
    """The run's length: ``--steps``, or ``--epochs`` x the data's samples / the global batch (rounded up), or 100."""
    if args.epochs is not None:
        return max(1, math.ceil(args.epochs * data.num_samples() / global_batch_size))
    return args.steps if args.steps is not None else 100


def sum_over_ranks(values: torch.Tensor, world: int) -> torch.Tensor:
    """``values`` summed over every rank (in place; the tensor itself on one rank)."""
    if world > 1:
        dist.all_reduce(values)
    return values


def max_over_ranks(values: torch.Tensor, world: int) -> torch.Tensor:
    """``values``' largest over every rank (in place; the tensor itself on one rank)."""
    if world > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def fail_once(message: str, rank: int) -> int:
    """Prints an error every rank has once (rank 0) and returns the exit status 1."""
    if rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return 1


@dataclass
class _Run:
    """One recipe run across its steps: what ``train`` was given and what its parts share."""

    args: argparse.Namespace
    model: Any
    optimizer: Any
    plan: Any
    data: Any
    script: str
    model_name: str
    num_params: int
    device: torch.device
    rank: int
    world: int
    notes: list[str]
    steps: int = 0
    start_step: int = 0
    stop_step: int = 0
    steps_done: int = 0
    warmup: int = 1
    meta: dict = field(default_factory=dict)
    eval_batches: list = field(default_factory=list)
    header: dict = field(default_factory=dict)
    reporter: Reporter | None = None
    fp16_watch: Fp16Watch | None = None
    checkpoint_extra: dict = field(default_factory=dict)
    best_loss: float = math.inf  # the best evaluation so far; it travels in every checkpoint (--keep-best)
    stop_requested: list[int] = field(default_factory=list)


def train(
    args: argparse.Namespace,
    model,
    optimizer,
    plan,
    data,
    *,
    script: str,
    model_name: str,
    num_params: int,
    device: torch.device,
    rank: int,
    world: int,
    notes: list[str] | None = None,
) -> int:
    """Runs the training steps of ``args`` (length, resume, schedule, evaluation, logging, checkpoints).

    Args:
        args: the recipe's options (add_training_args); ``args.steps`` is set to the run's length.
        model: the ElixirModel ``setup`` returned.
        optimizer: its sharded optimizer.
        plan: the plan the job runs.
        data: the training data (``TrainData``, or text_data.py's): ``batch``, ``num_samples``, ``epoch``,
            ``eval_batches``, ``describe``.
        script: the recipe's name, for the log.
        model_name: the model's name, for the log.
        num_params: its parameter count (FLOPs per token).
        device: where this rank computes.
        rank: this process's global rank (0 reports).
        world: the number of processes.
        notes: lines rank 0 prints after the run's first line (what a default chose, advice on the data).

    Returns:
        0 when the steps are done, 130 when interrupted (after saving with --save), 1 when a step's loss or
        gradient norm was not finite (``NonFiniteError``; nothing is saved after it) or a checkpoint failed.
    """
    run = _Run(args, model, optimizer, plan, data, script, model_name, num_params, device, rank, world, notes or [])
    problem = _prepare(run) or _open_reports(run)
    if problem:
        return fail_once(problem, rank)
    if args.save:
        _defer_signals(run)
    return _loop(run)


def _prepare(run: _Run) -> str | None:
    """The run's length, evaluation split, restart, lock, resume and stop step; the problem, if any."""
    args, training = run.args, run.plan.training
    run.steps = args.steps = run_steps(args, run.data, training.global_batch_size)  # the schedule speaks of it
    eval_batches = run.data.eval_batches(training.micro_batch_size)
    run.eval_batches = list(eval_batches) if eval_batches is not None else []
    if (args.eval_every or args.keep_best) and not run.eval_batches:
        return "--eval-every/--keep-best need an evaluation split: add --eval-fraction F or --eval-data"
    # torchrun restarted the workers: go on from this job's checkpoint (every rank alike: the largest count)
    counts = torch.tensor([float(restart_count())], dtype=torch.float64, device=run.device)
    restart_note = resume_after_restart(args, round(float(max_over_ranks(counts, run.world))))
    if restart_note and run.rank == 0:
        print(restart_note, flush=True)
    try:  # a second job saving to the same directory is refused before it trains
        if args.save:
            elixir_tune.lock_checkpoint_dir(args.save, run.model)
        run.meta = elixir_tune.load_checkpoint(args.resume, run.model, run.optimizer) if args.resume else {}
    except CheckpointError as error:  # every rank has the same one-line error
        return str(error)
    if args.resume:
        run.start_step = int(run.meta["step"])
        changed = data_change(run.meta.get("extra", {}), args)
        if changed and not args.new_data:  # every rank sees the same files: all refuse alike
            return data_refusal(changed)
        _say_resumed(run, changed)
    run.steps_done = run.start_step
    run.stop_step = min(run.steps, args.stop_at) if args.stop_at is not None else run.steps
    if run.stop_step <= run.start_step:  # nothing would run, and a save would relabel the checkpoint as done
        stop = args.stop_at is not None and args.stop_at < run.steps
        what = f"--stop-at {args.stop_at}" if stop else f"--steps {run.steps}"
        return f"{what} is not after the checkpoint's step {run.start_step}: nothing would train; give a later step"
    run.fp16_watch = Fp16Watch(run.optimizer) if training.dtype == "fp16" else None
    run.warmup = args.warmup_steps if args.warmup_steps is not None else max(1, run.steps // 10)
    run.checkpoint_extra = {
        "steps": run.steps,
        "seed": args.seed,
        "lr": args.lr,
        "warmup_steps": run.warmup,
        **data_record(args),  # what the run really trains on ("synthetic" for random tokens)
    }
    run.best_loss = float(run.meta.get("extra", {}).get("best_eval_loss", math.inf))
    return None


def _say_resumed(run: _Run, data_changed: str | None) -> None:
    """Rank 0 says where the run resumed, and which settings and data differ from the checkpoint's."""
    if run.rank != 0:
        return
    args, saved = run.args, run.meta.get("extra", {})
    print(
        f"resumed from {args.resume} at step {run.start_step}"
        + ("" if run.meta.get("exact") else " (weights only: optimizer state restarts)"),
        flush=True,
    )
    for key, value in (("steps", args.steps), ("seed", args.seed), ("lr", args.lr)):
        if key in saved and saved[key] != value:
            print(
                f"note: the checkpoint was saved with --{key} {saved[key]}, this run uses {value}: "
                "the data or LR schedule differs from the original run",
                flush=True,
            )
    if data_changed:  # allowed by --new-data, and said where the user looks first
        print(f"warning: --new-data: {data_changed}; the run goes on with this data", flush=True)


def _header(run: _Run, described: str) -> dict:
    """The JSON log's header: the run, the plan and its promise."""
    training = run.plan.training
    header = {
        "script": run.script,
        "plan": os.environ.get(elixir_tune.plan.PLAN_ENV_VAR, ""),
        "model": run.model_name,
        "num_params": run.num_params,
        "world_size": run.world,
        "device": run.plan.cluster.device,
        "dtype": training.dtype,
        "global_batch_size": training.global_batch_size,
        "micro_batch_size": training.micro_batch_size,
        "grad_accum_steps": training.grad_accum_steps,
        "seq_len": training.seq_len,
        "data": described,
        "lr": run.args.lr,
        "seed": run.args.seed,
        "steps_planned": run.steps,
        # On the CPU the steps' memory is measured above this (mark_process_start).
        "process_start_bytes": _start_bytes,
        **promise(run.plan, run.rank),
    }
    if run.args.resume:
        header["resumed_from"] = {"checkpoint": run.args.resume, "step": run.start_step}
    return header


def _open_reports(run: _Run) -> str | None:
    """Rank 0 opens the log, TensorBoard's writer and W&B's run; a failure reaches every rank before the
    first step's collectives (shared_errors), or the others would wait for it there."""
    args, training = run.args, run.plan.training
    # describe() may encode every training sample to count tokens: rank 0 alone reports it.
    described = run.data.describe().removeprefix("data: ") if run.rank == 0 else ""
    run.header = _header(run, described)
    log_error = None
    if run.rank == 0:
        try:
            if args.log:  # its place is writable now (a failed write later warns and training goes on: progress.py)
                probe = Path(args.log).with_name(f".{Path(args.log).name}.probe")
                probe.parent.mkdir(parents=True, exist_ok=True)
                probe.write_text("")
                probe.unlink()
            run.reporter = Reporter(args, run.header, run.steps)
        except Exception as failure:  # noqa: BLE001  (the writers raise OSError, wandb its own errors)
            cause = " ".join(str(failure).split()) if isinstance(failure, OSError) else describe_failure(failure)
            log_error = f"rank 0 could not open the run's logs (--log, --log-dir, --wandb): {cause}"
    log_errors = shared_errors(world_comm(run.model), log_error)
    if log_errors:
        return log_errors[0]
    reporter = run.reporter
    if reporter is None:
        return None
    if run.start_step:
        reporter.progress.update(reporter.task, completed=run.start_step)
    length = f"{run.steps} steps" + (f" ({args.epochs:g} epochs)" if args.epochs is not None else "")
    dp = run.plan.data_parallel_size
    reporter.say(
        f"training {run.model_name} ({run.num_params:,} params) on {run.world} {run.plan.cluster.device} worker(s): "
        f"{length} of {training.global_batch_size} x {training.seq_len} tokens "
        f"(micro-batch {training.micro_batch_size} x accumulation {training.grad_accum_steps} x data-parallel {dp}"
        + (f"; {run.world} workers" if dp != run.world else "")
        + f"), data: {described}"
    )
    for note in run.notes:
        reporter.say(escape(note))  # plain text: a [ in a file name is no markup
    return None


def _defer_signals(run: _Run) -> None:
    """With --save, a signal only raises a flag: every rank finishes the step, they agree on the flag (one
    all-reduce with the loss) and save together; a collective save cannot start mid-step."""

    def request_stop(signum, frame):
        if run.stop_requested:  # a second signal: stop now, without saving
            raise KeyboardInterrupt
        run.stop_requested.append(signum)

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)


def _save(run: _Run, steps_done: int, root: str | None = None, keep: int | None = None) -> None:
    args = run.args
    directory = elixir_tune.save_checkpoint(
        root or args.save,
        run.model,
        run.optimizer,
        step=steps_done,
        extra=run.checkpoint_extra,
        keep=keep or args.keep or None,
    )
    if run.reporter:
        run.reporter.say(f"saved checkpoint {directory} at step {steps_done}")


def _evaluate(run: _Run, steps_done: int) -> None:
    result = evaluate(run.model, run.eval_batches, elixir_tune.data_rank(), elixir_tune.data_size(), run.device)
    best = result.loss < run.best_loss
    if best:
        run.best_loss = run.checkpoint_extra["best_eval_loss"] = result.loss
    if run.reporter:
        run.reporter.evaluation(steps_done, result.loss, result.perplexity, result.tokens, best)
    if best and run.args.keep_best:
        _save(run, steps_done, root=str(Path(run.args.save) / BEST_DIR_NAME), keep=1)


def _step(run: _Run, step: int) -> tuple[bool, float]:
    """One optimizer step over the global batch; whether a stop was requested on any rank, and the loss."""
    args, training, device = run.args, run.plan.training, run.device
    micro, accum = training.micro_batch_size, training.grad_accum_steps
    # Each data-parallel index trains on its rows; the ranks of one pipeline (or tensor) group share them.
    data_rank, data_size = elixir_tune.data_rank(), elixir_tune.data_size()
    lr = lr_at(step, run.steps, args.lr, run.warmup)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    started = time.perf_counter()
    rows = run.data.batch(step, training.global_batch_size, data_rank, data_size)
    counts = token_counts(rows, getattr(run.data, "pad_id", None))
    micro_batches = [
        {k: v[begin : begin + micro].to(device, non_blocking=True) for k, v in rows.items()}
        for begin in range(0, micro * accum, micro)
    ]
    # All micro-batches as the plan says (standard or layered accumulation), each weighted by its
    # loss tokens: the step's loss and gradient are those of the whole global batch's tokens.
    loss_share = run.model.forward_backward(micro_batches, loss_fn=step_loss, weight_by_tokens=True).float()
    grad_norm = run.optimizer.clip_grad_norm(args.clip) if args.clip > 0 else None
    run.optimizer.step()
    run.optimizer.zero_grad()
    # The step's loss is the mean of the ranks' shares (for the log), and the stop flag goes with it.
    # float64: the token counts stay exact summed over every rank. The ranks of one pipeline or
    # tensor group had the same rows, so the sum counts each row world / data_size times.
    stop_flag = torch.tensor([float(bool(run.stop_requested))], dtype=torch.float64)
    flagged = torch.cat([loss_share.double().reshape(1), stop_flag.to(device), counts.to(device)])
    loss_sum, stop_now, *summed = sum_over_ranks(flagged, run.world).unbind()
    mean_loss = float(loss_sum) / run.world
    step_counts = torch.stack(summed).cpu() / (run.world // data_size)
    ops_for(device).synchronize()
    step_time_s = time.perf_counter() - started
    if run.reporter:
        run.reporter.step(
            {
                "step": step + 1,  # counted from 1, as the console and the checkpoints count
                "loss": mean_loss,
                "lr": lr,
                "epoch": run.data.epoch(step + 1, training.global_batch_size),
                "step_time_s": step_time_s,
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                # tokens/s and TFLOP/s of the tokens with a loss; padding and the rest apart
                **step_figures(
                    step_counts, step_time_s, run.num_params, run.world, run.header.get("peak_tflops_per_worker")
                ),
                "memory_bytes": memory_bytes(device),
            }
        )
    return bool(stop_now > 0), mean_loss


def _after_step(run: _Run, stop_now: bool, mean_loss: float) -> None:
    """A requested stop (after saving), evaluation and the periodic checkpoint after a step."""
    args, steps_done = run.args, run.steps_done
    # fp16: a skipped or non-finite step is not saved as progress; a run of them stops the run
    bad_step = run.fp16_watch.after_step(steps_done, mean_loss) if run.fp16_watch else False
    if stop_now:
        _save(run, steps_done)
        raise KeyboardInterrupt
    before_end = steps_done < run.stop_step
    if run.eval_batches and args.eval_every and steps_done % args.eval_every == 0 and before_end:
        _evaluate(run, steps_done)
    if args.save and args.save_every and steps_done % args.save_every == 0 and before_end and not bad_step:
        _save(run, steps_done)


def _loop(run: _Run) -> int:
    """The steps, the final evaluation and checkpoint, and how the run ended (its exit status)."""
    reporter = run.reporter
    try:
        with reporter or contextlib.nullcontext():
            for step in range(run.start_step, run.stop_step):
                stop_now, mean_loss = _step(run, step)
                run.steps_done = step + 1
                _after_step(run, stop_now, mean_loss)
            if run.eval_batches and run.steps_done > run.start_step:
                _evaluate(run, run.steps_done)
            if run.args.save and run.steps_done > run.start_step:
                _save(run, run.steps_done)
    except elixir_tune.NonFiniteError as error:  # fp32/bf16: a NaN/inf step; every save refuses after it
        if reporter:
            reporter.write(status="non-finite")
            reporter.say(f"[bold red]error[/]: {error}")
        return 1
    except KeyboardInterrupt:
        if reporter:
            reporter.write(status="interrupted")
            reporter.say(f"interrupted after step {run.steps_done}; log so far: {reporter.log_path}")
            reporter.say_prediction()
            if run.args.save and (Path(run.args.save) / LATEST_NAME).exists():
                reporter.say(f"continue with --resume {run.args.save} (same --steps, --seed and --lr)")
        return 130
    except CheckpointError as error:  # a refused save (non-finite weights, disk full): the old ones stay
        if reporter:
            reporter.write(status="failed")
        return fail_once(str(error), run.rank)
    except RuntimeError as error:
        lost = lost_peer_line(error, run.rank, run.steps_done + 1)
        if lost is None:
            raise
        # Another worker died (killed, crashed): this rank's collective failed because of it. One line instead of
        # gloo's traceback; elixir-run's summary then names the worker that failed first.
        if reporter:
            reporter.write(status="failed")
        print(f"error: {lost}", file=sys.stderr, flush=True)
        return 1
    if reporter:
        _say_done(reporter)
    return 0


def _say_done(reporter: Reporter) -> None:
    reporter.write(status="finished")
    summary = reporter.record.get("summary", {})
    if summary:
        reporter.say(
            f"[bold green]done[/]: loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} over "
            f"{summary['steps_done']} steps, {summary['mean_tokens_per_s']:,.0f} tokens/s learned "
            f"({summary['mean_computed_tokens_per_s']:,.0f} computed), "
            f"{summary['mean_step_time_s'] * 1000:.1f} ms/step"
            + (f"; best eval loss {summary['best_eval_loss']:.4f}" if "best_eval_loss" in summary else "")
            + (f"; log: {reporter.log_path}" if reporter.log_path else "")
        )
    reporter.say_prediction()
