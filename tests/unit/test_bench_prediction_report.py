"""scripts/bench_prediction_report.py's near ties: which layouts the measurement itself cannot order."""

from __future__ import annotations

import sys

from elixir_tune import paths

sys.path.insert(0, str(paths.REPO_DIR / "scripts"))
from bench_prediction_report import (  # noqa: E402
    format_order,
    near_ties,
    order_agrees,
    run_spread_s,
    tie_aware_order,
    tie_ranking,
)


def _row(name: str, predicted_s: float, round_medians_s: list[float]) -> dict:
    median = sorted(round_medians_s)[len(round_medians_s) // 2]
    return {
        "name": name,
        "predicted_step_time_s": predicted_s,
        "measured_median_step_time_s": median,
        "measured": {"round_medians_s": round_medians_s},
    }


def test_the_spread_is_the_runs_largest_median_less_the_smallest():
    assert run_spread_s([0.285, 0.517]) == 0.517 - 0.285
    assert run_spread_s([0.3]) == 0.0


def test_two_shapes_tie_when_their_medians_differ_by_no_more_than_the_larger_spread():
    medians = {"data": 0.300, "pipeline": 0.320, "tensor": 0.500}
    spreads = {"data": 0.010, "pipeline": 0.025, "tensor": 0.010}
    ties = near_ties(medians, spreads)
    assert ties == {"data": ["pipeline"], "pipeline": ["data"], "tensor": []}
    groups = tie_aware_order(medians, ties)
    assert groups == [["data", "pipeline"], ["tensor"]]
    assert format_order(groups) == "data ≈ pipeline < tensor"
    # Within a tie either predicted order agrees; across groups it must be the measured one.
    assert order_agrees({"data": 0.31, "pipeline": 0.30, "tensor": 0.4}, groups)
    assert not order_agrees({"data": 0.31, "pipeline": 0.30, "tensor": 0.2}, groups)
    # With tight spreads the same medians are three separate places.
    tight = near_ties(medians, dict.fromkeys(medians, 0.005))
    assert tie_aware_order(medians, tight) == [["data"], ["pipeline"], ["tensor"]]


def test_tie_ranking_states_the_strict_and_the_tie_aware_order():
    # The idle run 2 of benchmarks/results/prediction-cpu-layouts-idle-run2.md (in git at 4ecf109) in shape:
    # pipeline 2 bimodal.
    rows = [
        _row("data-only", 0.3394, [0.3604, 0.2868]),
        _row("pipeline-2", 0.3365, [0.5168, 0.2848]),
        _row("tensor-2", 0.5313, [0.5273, 0.5387]),
    ]
    ranking = tie_ranking(rows)
    assert ranking["predicted_order"] == "pipeline-2 < data-only < tensor-2"
    assert ranking["measured_order_strict"] == "data-only < pipeline-2 < tensor-2"
    assert not ranking["agree_strict"]
    assert ranking["measured_order_tie_aware"] == "data-only ≈ pipeline-2 ≈ tensor-2"
    assert ranking["agree_tie_aware"]
    assert rows[1]["near_ties"] == ["data-only", "tensor-2"]
    assert abs(rows[1]["run_spread_s"] - (0.5168 - 0.2848)) < 1e-12
