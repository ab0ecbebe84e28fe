"""`elixir-tune validate PLAN`: schema and consistency check, every problem listed."""

from __future__ import annotations

import click

from elixir_tune.cli.console import EXIT_FAILED, console, err_console, print_json
from elixir_tune.plan import PlanError, read_plan_dict, validate_dict
from elixir_tune.profiler.plan_match import plan_profile_problems, profile_beside


@click.command("validate")
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print {valid, problems} as JSON.")
def validate_command(plan_path: str, as_json: bool) -> None:
    """Check a plan file and list every problem with its field path.

    A plan is also compared with the profile it was searched from (its search.profile), when that
    file is still there: every parameter in a chunk, chunk sizes, blocks and sequence length.
    Exits 0 when the plan is valid, 1 when it is not.

    \b
    Example:
        elixir-tune validate configs/plans/example.yaml
    """
    note = ""
    try:
        raw = read_plan_dict(plan_path)
        problems = validate_dict(raw)
        if not problems:  # the profile's rules read fields that validate_dict has checked
            profile, note = profile_beside(raw, plan_path)
            problems = plan_profile_problems(raw, profile) if profile else []
    except PlanError as error:
        problems = error.problems
    if as_json:
        print_json({"plan": plan_path, "valid": not problems, "problems": problems, "profile_check": note})
    elif problems:
        err_console.print(f"[bold red]{plan_path}: {len(problems)} problem(s)[/]")
        for problem in problems:
            err_console.print(f"  - {problem}", soft_wrap=True, markup=False)
    else:
        console.print(f"[green]{plan_path}: valid[/] ({note})", soft_wrap=True)
    if problems:
        raise SystemExit(EXIT_FAILED)
