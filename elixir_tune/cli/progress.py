"""Rank 0's view of a run: a rich progress bar (step, ETA, tokens/s, loss, learning rate) on a terminal, plain
lines every few steps (the only output where stdout is not a terminal, as in CI), evaluation lines, the JSON log
of every step and evaluation, and the metric sinks (TensorBoard, W&B; metrics.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from elixir_tune.recipes.metrics import MetricSinks
from elixir_tune.recipes.throughput import compare


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
        number = entry["step"]  # counted from 1
        scalars = {
            "train/loss": entry["loss"],
            "train/lr": entry["lr"],
            "train/tokens_per_s": entry["tokens_per_s"],
            "train/computed_tokens_per_s": entry["computed_tokens_per_s"],
            "train/padding_fraction": entry["tokens_padding"] / max(1, entry["tokens_computed"]),
            "train/no_loss_fraction": entry["tokens_no_loss"] / max(1, entry["tokens_computed"]),
        }
        if entry.get("mfu") is not None:
            scalars["train/mfu"] = entry["mfu"]
        self.sinks.log(number, scalars)
        if number == 1 or number % self.print_every == 0 or number == self.steps:
            self.say(
                f"step {number:>5}/{self.steps}  loss {entry['loss']:.4f}  {entry['tokens_per_s']:>9,.0f} tok/s "
                f"learned{split_note(entry)}  {entry['tflops_per_gpu']:.4f} TFLOPS/worker"
                + (f" (MFU {entry['mfu']:.1%})" if entry.get("mfu") is not None else "")
                + f"  {entry['step_time_s'] * 1000:7.1f} ms  mem {entry['memory_bytes'] / 2**20:,.0f} MiB  "
                f"lr {entry['lr']:.2e}  epoch {entry['epoch']:.2f}"
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

    def say_prediction(self) -> None:
        """The run's last lines: predicted against measured step time and peak memory, and what to do about a
        gap beyond 1.5x (``write`` with the run's final status computes them, for the JSON log too)."""
        check = self.record.get("summary", {}).get("prediction")
        if not check:
            return
        measured_ms = check["measured_step_time_s"] * 1000
        measured_mib = check["measured_peak_memory_bytes"] / 2**20
        if check["step_time_ratio"] is None:
            self.say(
                f"plan vs run: the plan has no prediction (plans from `elixir-tune search` carry one); measured "
                f"{measured_ms:.1f} ms/step, peak memory {measured_mib:,.0f} MiB"
            )
            return
        line = (
            f"plan vs run: step time {check['predicted_step_time_s'] * 1000:.1f} ms predicted, {measured_ms:.1f} ms "
            f"measured ({check['step_time_ratio']:.2f}x)"
        )
        if check["memory_ratio"] is not None:
            # On the CPU: what the process grew by once the model was built (recipes/loop.py mark_process_start).
            grown = ", the process's growth past its libraries" if self.record.get("device") == "cpu" else ""
            line += (
                f"; peak memory {check['predicted_peak_memory_bytes'] / 2**20:,.0f} MiB predicted, "
                f"{measured_mib:,.0f} MiB measured ({check['memory_ratio']:.2f}x{grown})"
            )
        self.say(line)
        for advice in check["advice"]:
            self.say(f"[yellow]note[/]: {escape(advice)}")

    def write(self, status: str = "running") -> None:
        """The summary, and the JSON log replaced whole (readers never see a half-written one)."""
        steps = self.record["steps"]
        if steps:
            timed = steps[1:] or steps  # the first step includes warm-up work
            self.record["summary"] = {
                "status": status,
                "steps_done": len(steps),
                "first_loss": steps[0]["loss"],
                "last_loss": steps[-1]["loss"],
                # tokens over time, not the mean of the steps' rates: a step with more padding weighs its share
                "mean_tokens_per_s": sum(s["tokens"] for s in timed) / sum(s["step_time_s"] for s in timed),
                "mean_computed_tokens_per_s": sum(s["tokens_computed"] for s in timed)
                / sum(s["step_time_s"] for s in timed),
                "tokens": sum(s["tokens"] for s in steps),
                "tokens_padding": sum(s["tokens_padding"] for s in steps),
                "tokens_no_loss": sum(s["tokens_no_loss"] for s in steps),
                "tokens_computed": sum(s["tokens_computed"] for s in steps),
                "mean_step_time_s": sum(s["step_time_s"] for s in timed) / len(timed),
                "peak_memory_bytes": max(s["memory_bytes"] for s in steps),
            }
            if status != "running":  # the run's end: the plan's promise beside what was measured
                self.record["summary"]["prediction"] = compare(
                    self.record,
                    self.record["summary"]["mean_step_time_s"],
                    self.record["summary"]["peak_memory_bytes"],
                    str(self.record.get("device", "")),
                )
            if self.record["evals"]:
                self.record["summary"]["last_eval_loss"] = self.record["evals"][-1]["loss"]
                self.record["summary"]["best_eval_loss"] = min(e["loss"] for e in self.record["evals"])
        if not self.log_path:
            return
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


def split_note(entry: dict) -> str:
    """Where the step's other token positions went: `` (of 3,456/s computed: 58% padding, 6% no loss)``, or
    nothing when every position had a loss."""
    computed = entry["tokens_computed"]
    if not computed or entry["tokens"] == computed:
        return ""
    parts = [f"{entry['tokens_padding'] / computed:.0%} padding"] if entry["tokens_padding"] else []
    if entry["tokens_no_loss"]:
        parts.append(f"{entry['tokens_no_loss'] / computed:.0%} no loss")
    return f" (of {entry['computed_tokens_per_s']:,.0f}/s computed: {', '.join(parts)})"
