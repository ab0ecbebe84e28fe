"""Where rank 0 sends the run's numbers besides the console and the JSON log: TensorBoard and Weights & Biases.

``--log-dir DIR`` writes TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``; needs the
``tensorboard`` package) and ``--wandb PROJECT`` logs to Weights & Biases (needs ``wandb``). Each is opened
before training starts, so a missing package is a one-line error, not a failure after the first step.
"""

from __future__ import annotations

import argparse


class MetricsError(RuntimeError):
    """A logger the options ask for cannot be opened (one line: which package to install)."""


def metric_problems(args: argparse.Namespace) -> list[str]:
    """What the asked-for loggers lack (for elixir-run's preflight): one line each."""
    import importlib.util

    problems = []
    if getattr(args, "log_dir", None) and importlib.util.find_spec("tensorboard") is None:
        problems.append(f"--log-dir {args.log_dir} writes TensorBoard files: pip install tensorboard")
    if getattr(args, "wandb", None) and importlib.util.find_spec("wandb") is None:
        problems.append(f"--wandb {args.wandb} logs to Weights & Biases: pip install wandb (and `wandb login`)")
    return problems


class MetricSinks:
    """The TensorBoard writer and the W&B run the options ask for (none, either or both)."""

    def __init__(self, args: argparse.Namespace, config: dict):
        problems = metric_problems(args)
        if problems:
            raise MetricsError(problems[0])
        self.writer = None
        self.run = None
        if args.log_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=args.log_dir)
            self.writer.add_text("run", " ".join(f"{key}={value}" for key, value in config.items()))
        if args.wandb:
            import wandb  # type: ignore[import-not-found]

            self.run = wandb.init(project=args.wandb, config=config)

    def log(self, step: int, values: dict[str, float]) -> None:
        """Scalars at an optimizer step (counted from 1), e.g. ``train/loss``, ``eval/loss``."""
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
        if self.run is not None:
            self.run.log(values, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.run is not None:
            self.run.finish()
