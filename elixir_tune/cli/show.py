"""`elixir-tune show PLAN` (not built yet)."""

from __future__ import annotations

import click

from elixir_tune.cli.console import EXIT_USAGE, fail


@click.command("show", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def show_command() -> None:
    """Explain a plan: memory breakdown, predicted timeline, chunk placement.

    \b
    Example:
        elixir-tune show plan.yaml
    """
    fail("`elixir-tune show` is not built yet: plan explanation is still to come.", code=EXIT_USAGE)
