"""Issue 23's checks over the published table (scripts/published_checks.py): rows built by hand, no search.

The plausibility bound is read from each free plan's breakdown as the report stores it, so a plan
predicted faster than its bound, a plan no bound applies to, and a large speed-up without its reason
are each named; and the table written from the stored report says so.
"""

from __future__ import annotations

import json
import sys

from elixir_tune import paths

sys.path.insert(0, str(paths.REPO_DIR / "scripts"))
import bench_published  # noqa: E402
from published_checks import bound_status, checks_text, issue_checks  # noqa: E402


def _plan(step_time_s: float, **bounds: float) -> dict:
    return {"step_time_s": step_time_s, "breakdown": {"compute_s": step_time_s, **bounds}}


def _row(name: str, free: dict, speedup: float = 1.0, reason: str = "") -> dict:
    row = {"name": name, "free": free, "free_speedup": speedup}
    if reason:
        row["speedup_reason"] = reason
    return row


def test_a_step_shorter_than_its_largest_bound_is_above_it():
    assert bound_status(_plan(2.0, bound_compute_s=1.0, bound_cpu_adam_s=2.5)) == "above"
    # Clamped to the bound (equal up to the report's rounding) is within it.
    assert bound_status(_plan(2.5, bound_compute_s=1.0, bound_cpu_adam_s=2.5 + 4e-6)) == "within"
    assert bound_status(_plan(3.0, bound_compute_s=1.0)) == "within"


def test_a_plan_without_bounds_or_without_a_plan_is_told_apart():
    assert bound_status(_plan(1.0)) == "none applies"
    assert bound_status(_plan(1.0, bound_compute_s=0.0, bound_pcie_s=0.0)) == "none applies"
    assert bound_status({"error": "no plan fits"}) == "no plan"


def test_issue_checks_name_the_rows_that_fail_or_escape():
    rows = [
        _row("fast", _plan(1.0, bound_compute_s=2.0)),
        _row("unbounded", _plan(1.0)),
        _row("explained", _plan(3.0, bound_compute_s=2.0), speedup=1.5, reason="micro_batch_size 8 -> 1"),
        _row("unexplained", _plan(3.0, bound_compute_s=2.0), speedup=1.31),
        _row("small", _plan(3.0, bound_compute_s=2.0), speedup=1.29),
    ]
    checks = issue_checks(rows, 1.3)
    assert checks == {
        "free_above_bound": ["fast"],
        "free_without_bound": ["unbounded"],
        "speedups_without_reason": ["unexplained"],
    }
    text = checks_text(checks, 1.3)
    assert "faster than their plausibility bound: 1 (fast)" in text
    assert "without their reason: 1 (unexplained)" in text


def test_the_stored_table_states_its_checks_and_none_fails():
    """benchmarks/results/published.json as committed: every free plan within its bound where one applies,
    every speed-up over 1.3x with its reason, and published.md written with the same summary."""
    report = json.loads((paths.REPO_DIR / "benchmarks" / "results" / "published.json").read_text())
    checks = issue_checks(report["rows"], bench_published.EXPLAIN_SPEEDUP)
    assert checks["free_above_bound"] == []
    assert checks["speedups_without_reason"] == []
    assert report["summary"]["checks"] == checks
    markdown = (paths.REPO_DIR / "benchmarks" / "results" / "published.md").read_text()
    assert checks_text(checks, bench_published.EXPLAIN_SPEEDUP) in markdown
