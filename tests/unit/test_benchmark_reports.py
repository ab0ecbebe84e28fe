"""benchmarks/results holds one report per benchmark: ``<name>.md`` and ``<name>.json``, each stating
the date, the machine, the commit and the load (scripts/report_meta.py writes the header)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
FIGURES = {".svg"}  # a drawing beside its report's pair
# published.{md,json} are rewritten on their own branch; their header has no load yet.
OWN_BRANCH = {"published"}


def _names() -> list[str]:
    return sorted({path.stem for path in RESULTS.iterdir() if path.suffix not in FIGURES})


def test_every_report_is_a_markdown_and_json_pair():
    for path in RESULTS.iterdir():
        assert path.suffix in {".md", ".json"} | FIGURES, f"{path.name}: reports are <name>.md + <name>.json"
        if path.suffix in FIGURES:
            assert path.with_suffix(".md").is_file(), f"{path.name}: a figure belongs to a report of its name"
    unpaired = [
        name for name in _names() if not (RESULTS / f"{name}.md").is_file() or not (RESULTS / f"{name}.json").is_file()
    ]
    assert not unpaired, f"reports without their .md or .json: {unpaired}"


@pytest.mark.parametrize("name", [name for name in _names() if name not in OWN_BRANCH])
def test_a_report_states_date_machine_commit_and_load(name: str):
    generated = json.loads((RESULTS / f"{name}.json").read_text()).get("generated")
    assert isinstance(generated, dict), f"{name}.json has no 'generated' header (scripts/report_meta.py)"
    for key in ("date", "machine", "commit", "load_after"):
        assert generated.get(key) not in (None, ""), f"{name}.json: generated.{key} is missing"
    head = (RESULTS / f"{name}.md").read_text()[:2000]
    assert f"commit {generated['commit']}" in head, f"{name}.md does not name its commit near the top"
    assert "load average" in head, f"{name}.md does not state the load near the top"
