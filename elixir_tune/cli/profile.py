"""`elixir-tune profile MODEL` (not built yet)."""

from __future__ import annotations

import click

from elixir_tune.cli.console import EXIT_USAGE, fail


@click.command("profile", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def profile_command() -> None:
    """Profile a model on the meta device and write profile.yaml.

    \b
    Example:
        elixir-tune profile configs/models/gpt2-tiny.yaml --batch-size 8 --seq-len 128
    """
    fail("`elixir-tune profile` is not built yet: the profiler is still to come.", code=EXIT_USAGE)
