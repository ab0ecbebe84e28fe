"""Issue 23's checks over the published table (scripts/published_checks.py): rows built by hand, no search.

The plausibility bound is read from each free plan's breakdown as the report stores it, so a plan
predicted faster than its bound, a plan no bound applies to, and a large speed-up without its reason
are each named; and the table written from the stored report says so.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from elixir_tune import paths

sys.path.insert(0, str(paths.REPO_DIR / "scripts"))
import bench_published  # noqa: E402
from published_checks import bound_status, checks_text, issue_checks  # noqa: E402
from published_first import FIRST_PREDICTIONS  # noqa: E402
from published_setups import PUBLISHED  # noqa: E402
from published_summary import on_bound, out_of_scope, summary  # noqa: E402


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


def _stored() -> dict:
    return json.loads((paths.REPO_DIR / "benchmarks" / "results" / "published.json").read_text())


def test_the_stored_table_states_its_checks_and_explains_its_speedups():
    """benchmarks/results/published.json as committed: every speed-up over 1.2x with its reason, and
    published.md written with the same summary and checks."""
    report = _stored()
    checks = issue_checks(report["rows"], bench_published.EXPLAIN_SPEEDUP)
    assert checks["speedups_without_reason"] == []
    assert report["summary"]["checks"] == checks
    markdown = (paths.REPO_DIR / "benchmarks" / "results" / "published.md").read_text()
    assert checks_text(checks, bench_published.EXPLAIN_SPEEDUP) in markdown


def test_no_free_plan_in_the_stored_table_is_predicted_faster_than_its_bound():
    assert issue_checks(_stored()["rows"], bench_published.EXPLAIN_SPEEDUP)["free_above_bound"] == []


def test_no_two_free_plans_sit_on_a_bound():
    report = _stored()
    assert report["summary"]["free_plans_on_a_bound"] == sum(on_bound(row["free"]) for row in report["rows"])
    assert report["summary"]["free_plans_on_a_bound"] <= 1


def test_out_of_scope_rows_are_marked_and_left_out_of_the_summary():
    rows = [
        {"name": "GPT-2 20B 1xA100-80G-PCIe (Gemini cpu, batch 8)", "ratio": 1.5, "free": {}},  # printed twice
        {"name": "GPT-2 12B 8xA100-40G (ZeRO-3)", "ratio": 14.0, "free": {}},  # window includes the first step
        {"name": "MPT-7b s2048 8xH100", "ratio": 1.1, "fitted_source": True, "free": {}},
        {"name": "Megatron GPT-1.7B 32xA100 (t1 p1)", "ratio": 1.0, "free": {}},
    ]
    assert out_of_scope(rows[0]) == "figure printed twice for different runs"
    assert out_of_scope(rows[1]) == "window includes the first step"
    s = summary(rows)
    assert s["compared"] == 2 and s["out_of_scope"]["compared"] == 2
    assert s["fitted"]["median_abs_error"] == pytest.approx(0.1)
    assert s["held_out"]["median_abs_error"] == pytest.approx(0.0)
    # Megatron 1.7B's first prediction (1.40, before any cost-model change) is judged, not its current one.
    assert s["held_out_first"]["median_abs_error"] == pytest.approx(0.40)


def test_every_setup_has_its_first_prediction_recorded():
    assert {setup.name for setup in PUBLISHED} == set(FIRST_PREDICTIONS)


def test_a_plan_on_its_bound_is_told_from_one_below_it():
    assert on_bound(_plan(2.0, bound_compute_s=2.0))
    assert on_bound(_plan(2.0, bound_compute_s=1.0, bound_clamp_s=1.0))  # reports written with the clamp
    assert not on_bound(_plan(2.5, bound_compute_s=2.0))


def test_mismatches_every_row_of_a_family_states_are_written_once():
    rows = [
        {"name": "a", "source_key": "k", "mismatches": ["shared", "own a"]},
        {"name": "b", "source_key": "k", "mismatches": ["shared"]},
        {"name": "c", "source_key": "other", "mismatches": ["alone"]},
    ]
    assert bench_published.shared_mismatches(rows) == {"k": ["shared"], "other": ["alone"]}


def test_memory_checks_name_configurations_that_ran_over_and_failed_ones_not_refused():
    ran = {"name": "ran", "pinned": {"tokens_per_s_per_gpu": 1.0, "peak_gpu_gib": 1.0, "usable_gib": 2.0}}
    over = {
        "name": "over",
        "pinned": {"tokens_per_s_per_gpu": 1.0, "over_usable_memory": True, "peak_gpu_gib": 3.0, "usable_gib": 2.0},
    }
    failed = {"name": "oom", "row": "| OOM |", "source": "s", "refused": False, "peak_gpu_gib": 1.5, "usable_gib": 2.0}
    text = "\n".join(bench_published.memory_lines({"rows": [ran, over], "failed": [dict(failed, plan="p")]}))
    assert "that ran: 2; predicted over the preset's usable memory" in text and "over: 3.0 > 2.0 GiB" in text
    assert "oom" in text and "NOT refused" in text


def test_the_stored_table_has_its_memory_checks():
    report = _stored()
    assert report.get("failed"), "published.json lacks the configurations that ran out of memory"
    markdown = (paths.REPO_DIR / "benchmarks" / "results" / "published.md").read_text()
    assert "\n".join(bench_published.memory_lines(report)) in markdown


def test_free_plans_over_what_the_source_ran_give_their_mechanism():
    from published_report import over_published_lines

    row = {"name": "r", "published_tokens_per_s_per_gpu": 100.0, "ratio": 1.3, "free": {"tokens_per_s_per_gpu": 130.0}}
    lines = over_published_lines([row, dict(row, name="slow", free={"tokens_per_s_per_gpu": 110.0})])
    assert len(lines) == 4 and lines[-1].startswith("- r (1.30x = pinned ratio 1.30 x speed-up 1.00)")
    assert "the model's error on the peer's own configuration" in lines[-1]


def test_the_pinned_plan_moves_the_peers_fp32_gathers():
    from published_setups import PUBLISHED

    from elixir_tune.hardware import load_hardware

    foundry = next(s for s in PUBLISHED if s.name == "MPT-7b s2048 8xH100")
    assert foundry.gather_width == 2.0 and foundry.cache_blocks == 2  # MP Mode DEFAULT, FULL_SHARD
    spec = load_hardware(foundry.hardware)
    assert bench_published.peer_links(spec, foundry).allgather_gbps == spec.allgather_gbps / 2
    # across nodes one rate carries both: 2 gathers at 2x and 1 reduce-scatter move 5 units where the plan moves 3
    nodes = dataclasses.replace(foundry, nodes=8)
    assert bench_published.peer_links(spec, nodes).inter_node_gbps == pytest.approx(spec.inter_node_gbps * 3 / 5)
    pure = next(s for s in PUBLISHED if s.name == "MPT-7b s2048 8xA100-40G")
    assert bench_published.peer_links(spec, pure) is spec
