"""Rank 0's view of a run: a rich progress bar (step, ETA, tokens/s, loss, learning rate) on a terminal, plain
lines every few steps (the only output where stdout is not a terminal, as in CI), evaluation lines, the JSON log
of every step and evaluation, and the metric sinks (TensorBoard, W&B; metrics.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from elixir_tune.recipes.metrics import MetricSinks


class Reporter:
    """Rank 0's progress bar, printed lines, JSON log and metric sinks."""

    def __init__(self, args: argparse.Namespace, header: dict, steps: int):
        self.console = Console(highlight=False)
        self.steps = steps
        self.print_every = args.print_every or max(1, steps // 20)
        self.log_path = Path(args.log) if args.log else None
        self.record: dict = {**header, "steps": [], "evals": []}
        self.sinks = MetricSinks(args, {k: v for k, v in header.items() if isinstance(v, (int, float, str))})
        self.progress = Progress(
            TextColumn("[bold]train[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("lr {task.fields[lr]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("mem {task.fields[mem]}"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
        )
        self.task = self.progress.add_task("train", total=steps, loss="-", lr="-", tps="-", mem="-")

    def __enter__(self) -> Reporter:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()
        self.sinks.close()

    def say(self, text: str) -> None:
        """A line above the bar (markup allowed)."""
        self.progress.console.print(text, soft_wrap=True)

    def step(self, entry: dict) -> None:
        """One optimizer step done: the bar, maybe a line, the sinks and the JSON log."""
        self.record["steps"].append(entry)
        self.progress.update(
            self.task,
            advance=1,
            loss=f"{entry['loss']:.3f}",
            lr=f"{entry['lr']:.2e}",
            tps=f"{entry['tokens_per_s']:,.0f}",
            mem=f"{entry['memory_bytes'] / 2**20:,.0f} MiB",
        )
        number = entry["step"] + 1
        self.sinks.log(
            number, {"train/loss": entry["loss"], "train/lr": entry["lr"], "train/tokens_per_s": entry["tokens_per_s"]}
        )
        if number == 1 or number % self.print_every == 0 or number == self.steps:
            self.say(
                f"step {number:>5}/{self.steps}  loss {entry['loss']:.4f}  {entry['tokens_per_s']:>9,.0f} tok/s  "
                f"{entry['tflops_per_gpu']:.4f} TFLOPS/worker  {entry['step_time_s'] * 1000:7.1f} ms  "
                f"mem {entry['memory_bytes'] / 2**20:,.0f} MiB  lr {entry['lr']:.2e}  epoch {entry['epoch']:.2f}"
            )
        self.write()

    def evaluation(self, steps_done: int, loss: float, perplexity: float, tokens: int, best: bool) -> None:
        """One evaluation: a line, the sinks and the JSON log."""
        entry = {"step": steps_done, "loss": loss, "perplexity": perplexity, "tokens": tokens, "best": best}
        self.record["evals"].append(entry)
        self.sinks.log(steps_done, {"eval/loss": loss, "eval/perplexity": perplexity})
        self.say(
            f"eval  {steps_done:>5}/{self.steps}  loss {loss:.4f}  perplexity {perplexity:,.2f}  "
            f"({tokens:,} tokens)" + ("  best so far" if best else "")
        )
        self.write()

    def write(self, status: str = "running") -> None:
        """The JSON log, replaced whole (readers never see a half-written one)."""
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
            if self.record["evals"]:
                self.record["summary"]["last_eval_loss"] = self.record["evals"][-1]["loss"]
                self.record["summary"]["best_eval_loss"] = min(e["loss"] for e in self.record["evals"])
        partial = self.log_path.with_suffix(self.log_path.suffix + ".tmp")
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(self.record, indent=1))
            partial.replace(self.log_path)
        except OSError as error:  # a full disk stops the log, not the run (the other ranks wait for this one)
            self.say(
                f"[bold yellow]warning[/]: cannot write the log {self.log_path} ({error}); training goes on without it"
            )
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            self.log_path = None
