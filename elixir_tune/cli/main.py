"""The `elixir-tune` command group."""

from __future__ import annotations

import click

from elixir_tune import __version__
from elixir_tune.cli.bench import bench_command
from elixir_tune.cli.export import export_command
from elixir_tune.cli.probe import probe_command
from elixir_tune.cli.profile import profile_command
from elixir_tune.cli.search import search_command
from elixir_tune.cli.show import show_command
from elixir_tune.cli.train import train_command
from elixir_tune.cli.validate import validate_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="elixir-tune")
def cli() -> None:
    """Auto-tune sharding, caching and CPU offload for training a large model on a few GPUs.

    \b
    One command (profile, search and run, cached):
        elixir-tune train path/to/model --data chat.jsonl --epochs 1 --save-pretrained out

    \b
    Typical flow:
        elixir-tune profile gpt2-tiny                         # -> profile.yaml
        elixir-tune probe --quick                             # -> hardware.yaml
        elixir-tune search --gpus 2 --hardware hardware.yaml  # -> plan.yaml
        elixir-run plan.yaml pretrain                         # or: finetune --model DIR --data FILE
    """


for command in (
    profile_command,
    probe_command,
    search_command,
    show_command,
    validate_command,
    export_command,
    train_command,
    bench_command,
):
    cli.add_command(command)


def main() -> None:
    cli(prog_name="elixir-tune")


if __name__ == "__main__":
    main()
