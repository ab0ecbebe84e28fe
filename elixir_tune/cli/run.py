"""`elixir-run PLAN SCRIPT [ARGS...]` (not built yet)."""

from __future__ import annotations

import click

from elixir_tune.cli.console import EXIT_USAGE, fail


@click.command("elixir-run", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                               "help_option_names": ["-h", "--help"]})
def run_command() -> None:
    """Check a plan against this machine and run SCRIPT under torchrun as the plan says.

    \b
    Example:
        elixir-run plan.yaml scripts/train_gpt2.py --steps 20
    """
    fail("`elixir-run` is not built yet: the launcher is still to come.", code=EXIT_USAGE)


def main() -> None:
    run_command(prog_name="elixir-run")
