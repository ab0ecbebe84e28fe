"""`elixir-tune search --gpus N` (not built yet)."""

from __future__ import annotations

import click

from elixir_tune.cli.console import EXIT_USAGE, fail


@click.command("search", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def search_command() -> None:
    """Search chunking, caching, offload, checkpointing and batching; write plan.yaml.

    \b
    Example:
        elixir-tune search --gpus 4 --profile profile.yaml --hardware a100-40gb-pcie
    """
    fail("`elixir-tune search` is not built yet: the search is still to come.", code=EXIT_USAGE)
