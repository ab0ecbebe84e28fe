"""`elixir-tune probe` (not built yet)."""

from __future__ import annotations

import click

from elixir_tune.cli.console import EXIT_USAGE, fail


@click.command("probe", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def probe_command() -> None:
    """Measure this machine (GPUs or CPU) and write hardware.yaml.

    \b
    Example:
        elixir-tune probe --quick --out hardware.yaml
    """
    fail("`elixir-tune probe` is not built yet: the hardware probe is still to come.", code=EXIT_USAGE)
