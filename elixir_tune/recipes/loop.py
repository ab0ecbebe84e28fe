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
from pathlib import Path

import torch
import torch.distributed as dist

import elixir_tune
from elixir_tune.cli.progress import Reporter
from elixir_tune.engine.comm import shared_errors
from elixir_tune.engine.io.checkpoint_files import LATEST_NAME, CheckpointError
from elixir_tune.engine.io.pretrained_files import describe_failure
from elixir_tune.recipes.evaluation import evaluate
from elixir_tune.recipes.fp16_watch import Fp16Watch
from elixir_tune.recipes.restarts import lost_peer_line, restart_count, resume_after_restart
from elixir_tune.recipes.throughput import promise, step_figures, token_counts

BEST_DIR_NAME = "best"  # --keep-best: the best evaluation's checkpoint, a root of its own under --save


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

    Returns:
        0 when the steps are done, 130 when interrupted (after saving with --save), 1 when a step's loss or
        gradient norm was not finite (``NonFiniteError``; nothing is saved after it) or a checkpoint failed.
    """
    plan_path = os.environ.get(elixir_tune.plan.PLAN_ENV_VAR, "")
    training = plan.training
    steps = run_steps(args, data, training.global_batch_size)
    args.steps = steps  # the schedule, checkpoints and resume notes speak of the computed length
    eval_batches_iter = data.eval_batches(training.micro_batch_size)
    eval_batches = list(eval_batches_iter) if eval_batches_iter is not None else []
    if (args.eval_every or args.keep_best) and not eval_batches:
        return fail_once(
            "--eval-every/--keep-best need an evaluation split: add --eval-fraction F or --eval-data", rank
        )
    start_step = 0
    # torchrun restarted the workers: go on from this job's checkpoint (every rank alike: the largest count)
    counts = torch.tensor([float(restart_count())], dtype=torch.float64, device=device)
    restart_note = resume_after_restart(args, round(float(max_over_ranks(counts, world))))
    if restart_note and rank == 0:
        print(restart_note, flush=True)
    try:  # a second job saving to the same directory is refused before it trains
        if args.save:
            elixir_tune.lock_checkpoint_dir(args.save, model)
        meta = elixir_tune.load_checkpoint(args.resume, model, optimizer) if args.resume else {}
    except CheckpointError as error:  # every rank has the same one-line error
        return fail_once(str(error), rank)
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
    stop_step = min(steps, args.stop_at) if args.stop_at is not None else steps
    if stop_step <= start_step:  # nothing would run, and a save would relabel the checkpoint as done
        what = f"--stop-at {args.stop_at}" if args.stop_at is not None and args.stop_at < steps else f"--steps {steps}"
        return fail_once(
            f"{what} is not after the checkpoint's step {start_step}: nothing would train; give a later step", rank
        )
    fp16_watch = Fp16Watch(optimizer) if plan.training.dtype == "fp16" else None

    micro, accum = training.micro_batch_size, training.grad_accum_steps
    # Each data-parallel index trains on its rows; the ranks of one pipeline (or tensor) group share them.
    data_rank, data_size = elixir_tune.data_rank(), elixir_tune.data_size()
    # describe() may encode every training sample to count tokens: rank 0 alone reports it.
    described = data.describe().removeprefix("data: ") if rank == 0 else ""
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, steps // 10)
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
        "data": described,
        "lr": args.lr,
        "seed": args.seed,
        "steps_planned": steps,
        **promise(plan, rank),
    }
    if args.resume:
        header["resumed_from"] = {"checkpoint": args.resume, "step": start_step}
    # Rank 0 alone opens the log, TensorBoard's writer and W&B's run: its failure must reach every rank
    # before the first step's collectives (shared_errors), or the others would wait for it there.
    reporter, log_error = None, None
    if rank == 0:
        try:
            if args.log:  # its place is writable now (a failed write later warns and training goes on: progress.py)
                probe = Path(args.log).with_name(f".{Path(args.log).name}.probe")
                probe.parent.mkdir(parents=True, exist_ok=True)
                probe.write_text("")
                probe.unlink()
            reporter = Reporter(args, header, steps)
        except Exception as failure:  # noqa: BLE001  (the writers raise OSError, wandb its own errors)
            cause = " ".join(str(failure).split()) if isinstance(failure, OSError) else describe_failure(failure)
            log_error = f"rank 0 could not open the run's logs (--log, --log-dir, --wandb): {cause}"
    log_errors = shared_errors(model.engine.mesh.world, log_error)
    if log_errors:
        return fail_once(log_errors[0], rank)
    if reporter and start_step:
        reporter.progress.update(reporter.task, completed=start_step)
    if reporter:
        length = f"{steps} steps" + (f" ({args.epochs:g} epochs)" if args.epochs is not None else "")
        reporter.say(
            f"training {model_name} ({num_params:,} params) on {world} {plan.cluster.device} worker(s): "
            f"{length} of {training.global_batch_size} x {training.seq_len} tokens "
            f"(micro-batch {micro} x accumulation {accum} x data-parallel {plan.data_parallel_size}"
            + (f"; {world} workers" if plan.data_parallel_size != world else "")
            + f"), data: {described}"
        )

    checkpoint_extra = {"steps": steps, "seed": args.seed, "lr": args.lr, "warmup_steps": warmup, "data": args.data}

    def save(steps_done: int, root: str | None = None, keep: int | None = None) -> None:
        directory = elixir_tune.save_checkpoint(
            root or args.save, model, optimizer, step=steps_done, extra=checkpoint_extra, keep=keep or args.keep or None
        )
        if reporter:
            reporter.say(f"saved checkpoint {directory} at step {steps_done}")

    # The best evaluation so far travels in every checkpoint, so that a resumed run keeps --keep-best's record.
    best_loss = [float(meta.get("extra", {}).get("best_eval_loss", math.inf))]

    def run_eval(steps_done: int) -> None:
        result = evaluate(model, eval_batches, data_rank, data_size, device)
        best = result.loss < best_loss[0]
        if best:
            best_loss[0] = checkpoint_extra["best_eval_loss"] = result.loss
        if reporter:
            reporter.evaluation(steps_done, result.loss, result.perplexity, result.tokens, best)
        if best and args.keep_best:
            save(steps_done, root=str(Path(args.save) / BEST_DIR_NAME), keep=1)

    # With --save, a signal only raises a flag: every rank finishes the step, they agree on the flag
    # (one all-reduce with the loss) and save together; a collective save cannot start mid-step.
    stop_requested: list[int] = []
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
                lr = lr_at(step, steps, args.lr, warmup)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                started = time.perf_counter()
                rows = data.batch(step, training.global_batch_size, data_rank, data_size)
                counts = token_counts(rows, getattr(data, "pad_id", None))
                micro_batches = [
                    {k: v[begin : begin + micro].to(device, non_blocking=True) for k, v in rows.items()}
                    for begin in range(0, micro * accum, micro)
                ]
                # All micro-batches as the plan says (standard or layered accumulation), each weighted by its
                # loss tokens: the step's loss and gradient are those of the whole global batch's tokens.
                loss_share = model.forward_backward(micro_batches, loss_fn=step_loss, weight_by_tokens=True).float()
                grad_norm = optimizer.clip_grad_norm(args.clip) if args.clip > 0 else None
                optimizer.step()
                optimizer.zero_grad()
                # The step's loss is the mean of the ranks' shares (for the log), and the stop flag goes with it.
                # float64: the token counts stay exact summed over every rank. The ranks of one pipeline or
                # tensor group had the same rows, so the sum counts each row world / data_size times.
                stop_flag = torch.tensor([float(bool(stop_requested))], dtype=torch.float64)
                flagged = torch.cat([loss_share.double().reshape(1), stop_flag.to(device), counts.to(device)])
                loss_sum, stop_now, *summed = sum_over_ranks(flagged, world).unbind()
                mean_loss = float(loss_sum) / world
                step_counts = torch.stack(summed).cpu() / (world // data_size)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                step_time_s = time.perf_counter() - started
                if reporter:
                    reporter.step(
                        {
                            "step": step + 1,  # counted from 1, as the console and the checkpoints count
                            "loss": mean_loss,
                            "lr": lr,
                            "epoch": data.epoch(step + 1, training.global_batch_size),
                            "step_time_s": step_time_s,
                            "grad_norm": float(grad_norm) if grad_norm is not None else None,
                            # tokens/s and TFLOP/s of the tokens with a loss; padding and the rest apart
                            **step_figures(
                                step_counts, step_time_s, num_params, world, header.get("peak_tflops_per_worker")
                            ),
                            "memory_bytes": memory_bytes(device),
                        }
                    )
                steps_done = step + 1
                # fp16: a skipped or non-finite step is not saved as progress; a run of them stops the run
                bad_step = fp16_watch.after_step(steps_done, mean_loss) if fp16_watch else False
                if stop_now > 0:
                    save(steps_done)
                    raise KeyboardInterrupt
                if eval_batches and args.eval_every and steps_done % args.eval_every == 0 and steps_done < stop_step:
                    run_eval(steps_done)
                if (
                    args.save
                    and args.save_every
                    and steps_done % args.save_every == 0
                    and steps_done < stop_step
                    and not bad_step
                ):
                    save(steps_done)
            if eval_batches and steps_done > start_step:
                run_eval(steps_done)
            if args.save and steps_done > start_step:
                save(steps_done)
    except elixir_tune.NonFiniteError as error:  # fp32/bf16: a NaN/inf step; every save refuses after it
        if reporter:
            reporter.write(status="non-finite")
            reporter.say(f"[bold red]error[/]: {error}")
        return 1
    except KeyboardInterrupt:
        if reporter:
            reporter.write(status="interrupted")
            reporter.say(f"interrupted after step {steps_done}; log so far: {reporter.log_path}")
            reporter.say_prediction()
            if args.save and (Path(args.save) / LATEST_NAME).exists():
                reporter.say(f"continue with --resume {args.save} (same --steps, --seed and --lr)")
        return 130
    except CheckpointError as error:  # a refused save (non-finite weights, disk full): the old ones stay
        if reporter:
            reporter.write(status="failed")
        return fail_once(str(error), rank)
    except RuntimeError as error:
        lost = lost_peer_line(error, rank, steps_done + 1)
        if lost is None:
            raise
        # Another worker died (killed, crashed): this rank's collective failed because of it. One line instead of
        # gloo's traceback; elixir-run's summary then names the worker that failed first.
        if reporter:
            reporter.write(status="failed")
        print(f"error: {lost}", file=sys.stderr, flush=True)
        return 1
    if reporter:
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
    return 0
