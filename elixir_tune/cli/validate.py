"""`elixir-tune validate PLAN`: schema and consistency check, every problem listed."""

from __future__ import annotations

import click

from elixir_tune.cli.console import EXIT_FAILED, console, err_console, print_json
from elixir_tune.plan import PlanError, read_plan_dict, validate_dict


@click.command("validate")
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print {valid, problems} as JSON.")
def validate_command(plan_path: str, as_json: bool) -> None:
    """Check a plan file and list every problem with its field path.

    Exits 0 when the plan is valid, 1 when it is not.

    \b
    Example:
        elixir-tune validate configs/plans/example.yaml
    """
    try:
        problems = validate_dict(read_plan_dict(plan_path))
    except PlanError as error:
        problems = error.problems
    if as_json:
        print_json({"plan": plan_path, "valid": not problems, "problems": problems})
    elif problems:
        err_console.print(f"[bold red]{plan_path}: {len(problems)} problem(s)[/]")
        for problem in problems:
            err_console.print(f"  - {problem}", soft_wrap=True, markup=False)
    else:
        console.print(f"[green]{plan_path}: valid[/]")
    if problems:
        raise SystemExit(EXIT_FAILED)
