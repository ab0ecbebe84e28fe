"""The design pages stay true to the code: every file and function the decision map
(docs/costmodel-and-search.md) names exists, so a newcomer who follows the map lands on the code that
makes the choice, and the plan format table (docs/plan.md) lists every field of the schema."""

from __future__ import annotations

import ast
import re

from elixir_tune.paths import REPO_DIR

DOCS = REPO_DIR / "docs"
SEARCH_PAGE = DOCS / "costmodel-and-search.md"
PLAN_PAGE = DOCS / "plan.md"
PACKAGE = REPO_DIR / "elixir_tune"


def decision_map_rows() -> list[list[str]]:
    text = SEARCH_PAGE.read_text()
    start = text.index("## Decision map")
    section = text[start : text.index("\n## ", start + 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| choice")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows if not set(row) <= set("|- ")]


def defined_names(path) -> set[str]:
    """Top-level functions, classes and assignments of a module, and Class.method for methods."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {f"{node.name}.{item.name}" for item in node.body if isinstance(item, ast.FunctionDef)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names


def test_every_place_the_decision_map_names_exists():
    rows = decision_map_rows()
    assert len(rows) >= 12
    checked = 0
    for choice, _field, where, _how in rows:
        current = None
        for token in re.findall(r"`([^`]+)`", where):
            if token.endswith(".py"):
                current = PACKAGE / token
                assert current.is_file(), f"decision map ({choice}): {token} does not exist"
            else:
                assert current is not None, f"decision map ({choice}): {token} names no file"
                assert token in defined_names(current), f"decision map ({choice}): {token} is not in {current.name}"
                checked += 1
    assert checked >= 20


def test_the_docs_name_no_file_outside_the_repository():
    for page in DOCS.rglob("*.md"):
        text = page.read_text()
        assert "/work/" not in text, page  # links stay inside the repository: tests/unit/test_docs.py


def test_the_plan_format_table_lists_every_field_of_the_schema():
    import dataclasses

    from elixir_tune.plan.fields import section_type
    from elixir_tune.plan.schema import Plan

    text = PLAN_PAGE.read_text()
    section = text[text.index("## Fields") : text.index("## Fingerprint")]

    def paths(cls: type, prefix: str) -> list[str]:
        out = []
        for field in dataclasses.fields(cls):
            bare = section_type(cls, field.name)
            if dataclasses.is_dataclass(bare):
                out += paths(bare, f"{prefix}{field.name}.")
            elif getattr(bare, "__origin__", None) is list and dataclasses.is_dataclass(bare.__args__[0]):
                out += paths(bare.__args__[0], f"{prefix}{field.name}[].")
            else:
                out.append(prefix + field.name)
        return out

    missing = []
    for field in dataclasses.fields(Plan):
        if field.name in ("prediction", "search"):  # listed by name inside their row
            missing += [
                f"{field.name}.{name}"
                for name in paths(section_type(Plan, field.name), "")
                if f"`{name}`" not in section
            ]
        elif field.name == "schema_version":
            missing += [] if "`schema_version`" in section else ["schema_version"]
        else:
            missing += [
                path for path in paths(section_type(Plan, field.name), f"{field.name}.") if f"`{path}`" not in section
            ]
    assert not missing, f"docs/plan.md's fields table lacks {missing}"
