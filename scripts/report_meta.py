"""The header every report in benchmarks/results carries: date, machine, commit and load.

A benchmark script calls ``generated(load_before)`` when it writes its report, stores the dict
under ``"generated"`` in ``<name>.json`` and puts ``header_line`` at the top of ``<name>.md``;
``write_pair`` does both. The load average says how busy the machine was: on a shared machine
timings are loaded, predictions are not.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_DIR / "benchmarks" / "results"


def load_average() -> float:
    """The 1-minute load average (0.0 where the system has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return 0.0


def commit() -> str:
    """This checkout's short commit; ``+`` marks uncommitted changes to the code, scripts or configs."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_DIR)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "elixir_tune", "scripts", "configs"],
        capture_output=True,
        text=True,
        cwd=REPO_DIR,
    )
    return (head.stdout.strip() or "unknown") + ("+" if dirty.stdout.strip() else "")


def machine() -> str:
    return f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()})"


def generated(load_before: float | None = None, command: str = "") -> dict:
    """When, where and from which commit a report is written, and the load around its run.

    Args:
        load_before: the load average when the run started (None: only the one at the end).
        command: the command that reproduces the report.
    """
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "commit": commit(),
        "load_before": load_before,
        "load_after": load_average(),
    }
    if command:
        out["command"] = command
    return out


def header_line(g: dict) -> str:
    """The report's first line after its title: date, machine, commit, load (and the command)."""
    before = g.get("load_before")
    load = f"{before} before, {g.get('load_after')} after" if before is not None else f"{g.get('load_after')}"
    line = (
        f"Generated {g.get('date', '?')} on {g.get('machine', '?')} at commit {g.get('commit', '?')}; "
        f"load average {load} (a shared machine: timings are loaded, predictions are not)."
    )
    if g.get("note"):
        line += f" {g['note']}"
    if g.get("command"):
        line += f" Command: `{g['command']}`."
    return line


def write_pair(prefix: Path, report: dict, markdown: str) -> None:
    """Writes ``report`` as PREFIX.json and ``markdown`` as PREFIX.md (both carry ``report["generated"]``)."""
    prefix = Path(prefix)
    prefix.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    prefix.with_suffix(".md").write_text(markdown)


def with_header(markdown: str, g: dict) -> str:
    """``markdown`` with ``header_line(g)`` as the paragraph after its title (its first line)."""
    title, _, rest = markdown.partition("\n")
    return f"{title}\n\n{header_line(g)}\n{rest}"
