"""Reading and writing plans as YAML.

`load_plan` either returns a valid Plan or raises PlanError listing every problem; a YAML syntax
error names its line and column. `save_plan` writes a stable, readable document: saving a loaded
plan gives the same text again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from elixir_tune.files import InputFileError, load_yaml
from elixir_tune.plan.fields import build
from elixir_tune.plan.schema import Plan
from elixir_tune.plan.validate import validate_dict

PLAN_ENV_VAR = "ELIXIR_TUNE_PLAN"


class PlanError(ValueError):
    """A plan that cannot be used; ``problems`` lists every reason, each with its field path."""

    def __init__(self, path: str | os.PathLike, problems: list[str]):
        self.path = str(path)
        self.problems = problems
        lines = "\n".join(f"  - {problem}" for problem in problems)
        super().__init__(f"{self.path}: {len(problems)} problem(s):\n{lines}")


def read_plan_dict(path: str | os.PathLike) -> Any:
    """Reads a plan file into plain Python objects.

    Args:
        path: the plan's YAML file.

    Returns:
        The parsed document, not yet validated.

    Raises:
        PlanError: the file is missing, unreadable, binary, not UTF-8 or not well-formed YAML (with
            line and column).
    """
    path = Path(path)
    if not path.is_file() and not path.is_dir():
        raise PlanError(path, [f"file not found; write one with `elixir-tune search --out {path}`"])
    try:
        return load_yaml(path, "plan")
    except InputFileError as error:
        raise PlanError(path, [error.problem]) from None


def plan_from_dict(raw: dict) -> Plan:
    """Builds a Plan from a mapping that `validate_dict` accepted (missing optional fields take their defaults)."""
    return build(Plan, raw)


def plan_to_dict(plan: Plan) -> dict:
    """The plan as plain Python objects, sections in reading order, empty optional sections left out."""
    return plan.to_dict()


def load_plan(path: str | os.PathLike | None = None) -> Plan:
    """Loads and validates a plan.

    Args:
        path: the plan's YAML file; None reads the path from $ELIXIR_TUNE_PLAN.

    Returns:
        The plan.

    Raises:
        PlanError: the file is missing, is not YAML, or the plan has problems (all listed).
    """
    if path is None:
        path = os.environ.get(PLAN_ENV_VAR)
        if not path:
            raise PlanError(
                "<no plan>",
                [
                    f"no plan given and ${PLAN_ENV_VAR} is not set; pass plan= or "
                    "start the script with `elixir-run plan.yaml script.py`"
                ],
            )
    raw = read_plan_dict(path)
    problems = validate_dict(raw)
    if problems:
        raise PlanError(path, problems)
    return plan_from_dict(raw)


class _PlanDumper(yaml.SafeDumper):
    """Block style for sections, flow style for the small leaf mappings (one chunk per line)."""


def _represent_dict(dumper: yaml.SafeDumper, data: dict) -> yaml.Node:
    flat = all(
        not isinstance(v, dict) and not (isinstance(v, list) and v and isinstance(v[0], dict)) for v in data.values()
    )
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=flat and "id" in data)


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(isinstance(item, (str, int, float)) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_PlanDumper.add_representer(dict, _represent_dict)
_PlanDumper.add_representer(list, _represent_list)


def dump_plan(plan: Plan, header: str = "") -> str:
    """The plan as YAML text, with an optional comment header (each line prefixed with '# ')."""
    text = yaml.dump(plan_to_dict(plan), Dumper=_PlanDumper, sort_keys=False, width=100)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comment + text


def save_plan(plan: Plan, path: str | os.PathLike, header: str = "") -> None:
    """Writes a plan as YAML.

    Args:
        plan: the plan to write.
        path: where to write it.
        header: an optional comment for the top of the file.
    """
    Path(path).write_text(dump_plan(plan, header))
