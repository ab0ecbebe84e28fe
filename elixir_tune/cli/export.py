"""`elixir-tune export PLAN --to deepspeed|fsdp2|accelerate`: the engine's own configuration from a plan."""

from __future__ import annotations

import json
from pathlib import Path

import click
import yaml

from elixir_tune.cli.console import console, err_console, fail, print_json, refuse_output_over_input
from elixir_tune.plan import PlanError, load_plan

DEFAULT_OUT = {"deepspeed": "ds_config.json", "fsdp2": "fsdp2_setup.py", "accelerate": "accelerate_config.yaml"}


@click.command("export")
@click.argument("plan_path", metavar="PLAN", type=click.Path(exists=True, dir_okay=False))
@click.option("--to", "target", type=click.Choice(sorted(DEFAULT_OUT)), required=True, help="The engine to write for.")
@click.option("-o", "--out", type=click.Path(dir_okay=False), help="Where to write (default: by --to).")
@click.option("--block-class", help="accelerate: the class name of the model's blocks (auto wrap).")
@click.option("--json", "as_json", is_flag=True, help="Print {plan, target, out, not_expressed} as JSON.")
def export_command(plan_path: str, target: str, out: str | None, block_class: str | None, as_json: bool) -> None:
    """Write DeepSpeed's, FSDP2's or accelerate's configuration reproducing PLAN as far as it can,
    and list what it cannot express.

    \b
    Examples:
        elixir-tune export plan.yaml --to deepspeed          # -> ds_config.json
        elixir-tune export plan.yaml --to fsdp2              # -> fsdp2_setup.py (apply_plan(model))
        elixir-tune export plan.yaml --to accelerate --block-class LlamaDecoderLayer
        elixir-tune export plan.yaml --to deepspeed --json   # what was written, what was not expressed
    """
    try:
        plan = load_plan(plan_path)
    except PlanError as error:
        fail(f"{plan_path}: not a valid plan: " + "; ".join(error.problems[:3]), "check it with elixir-tune validate")
    path = Path(out or DEFAULT_OUT[target])
    refuse_output_over_input(str(path), {"PLAN": plan_path})
    if target == "deepspeed":
        from elixir_tune.export.deepspeed_config import deepspeed_config, deepspeed_unexpressed

        text, notes = json.dumps(deepspeed_config(plan), indent=2) + "\n", deepspeed_unexpressed(plan)
    elif target == "fsdp2":
        from elixir_tune.export.fsdp2_setup import fsdp2_setup_file

        text, notes = fsdp2_setup_file(plan, plan_path)
    else:
        from elixir_tune.export.fsdp2_setup import accelerate_config

        config, notes = accelerate_config(plan, block_class)
        text = yaml.safe_dump(config, sort_keys=False)
    path.write_text(text)
    if as_json:
        print_json({"plan": plan_path, "target": target, "out": str(path), "not_expressed": notes})
        return
    console.print(f"wrote {path} ({target})")
    if notes:
        err_console.print(f"not expressed in {target}'s configuration:")
        for note in notes:
            err_console.print(f"  - {note}", soft_wrap=True, markup=False)
