"""The summary of the published table (scripts/bench_published.py): errors by class, bounds, speed-ups.

Scope (issue 38): a row whose published figure averages a window that includes the run's first step
(``Setup.first_step_in_window``), or whose figure the source prints twice for different runs
(``Setup.printed_twice``), is out of scope: marked in the table and left out of every figure here
but its own line. In scope, the rows are split into those from tables the presets' rates were
fitted to (``Setup.fitted_source``) and the held-out rest, each judged on its current prediction and
on its first recorded one (``published_first.FIRST_PREDICTIONS``, which says where each is recorded).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from published_checks import issue_checks
from published_first import FIRST_ISSUE38, FIRST_PREDICTIONS
from published_setups import PUBLISHED

from elixir_tune.costmodel.rates import BOUND_KEYS

# A free plan this much faster than the pinned one gets its reason spelled out (issue 38's 1.2x).
EXPLAIN_SPEEDUP = 1.2
# A step this close to a bound (relative) sits on it: a clamp, or a tie the bound made.
ON_BOUND_REL = 1e-6
# The peers whose configurations the free plans are compared with in issue 38's item on micro-batches.
PEER_FAMILIES = ("megatron", "torchtitan", "llm-foundry", "llm-foundry-40gb")

_SETUPS = {setup.name: setup for setup in PUBLISHED}


def out_of_scope(row: dict) -> str:
    """Why a row is out of scope ("" when it is in): read from its setup, so older reports are judged alike."""
    setup = _SETUPS.get(row["name"])
    if row.get("first_step_in_window") or (setup is not None and setup.first_step_in_window):
        return "window includes the first step"
    if setup is not None and setup.printed_twice:
        return "figure printed twice for different runs"
    return ""


def first_ratio(row: dict) -> float | None:
    """The row's first recorded pinned ratio (None when none is recorded)."""
    first = FIRST_PREDICTIONS.get(row["name"])
    return first[0] if first else None


def on_bound(result: dict) -> bool:
    """The plan's predicted step equals one of its bounds (it was raised to it, or ties there)."""
    breakdown = result.get("breakdown") or {}
    if "step_time_s" not in result:
        return False
    if breakdown.get("bound_clamp_s", 0.0) > 0:
        return True
    step = result["step_time_s"]
    return any(abs(breakdown.get(key, 0.0) - step) <= ON_BOUND_REL * step for key in BOUND_KEYS)


def _stats(errors: list[float]) -> dict:
    if not errors:
        return {"compared": 0}
    return {
        "compared": len(errors),
        "median_abs_error": round(statistics.median(errors), 4),
        "max_abs_error": round(max(errors), 4),
        "within_10pct": sum(e <= 0.10 for e in errors),
        "beyond_25pct": sum(e > 0.25 for e in errors),
    }


def _current(rows: list[dict], keep: Callable[[dict], bool]) -> dict:
    return _stats([abs(row["ratio"] - 1) for row in rows if "ratio" in row and keep(row)])


def _first(rows: list[dict], keep: Callable[[dict], bool]) -> dict:
    return _stats([abs(ratio - 1) for row in rows if keep(row) and (ratio := first_ratio(row)) is not None])


def _speedups(rows: list[dict]) -> dict:
    values = sorted(row["free_speedup"] for row in rows if "free_speedup" in row)
    if not values:
        return {"compared": 0}
    return {
        "compared": len(values),
        "median": round(statistics.median(values), 3),
        "min": round(values[0], 3),
        "max": round(values[-1], 3),
        "over_1_2": sum(value > 1.2 for value in values),
    }


def summary(rows: list[dict]) -> dict:
    """Errors in scope (all, fitted, held out; current and first), out of scope, bounds and speed-ups."""

    def in_scope(row: dict) -> bool:
        return not out_of_scope(row)

    def fitted(row: dict) -> bool:
        return in_scope(row) and bool(row.get("fitted_source"))

    def held_out(row: dict) -> bool:
        return in_scope(row) and not row.get("fitted_source")

    frees = [row["free"] for row in rows if "breakdown" in row["free"]]
    peers = [row for row in rows if row.get("source_key") in PEER_FAMILIES]
    out = {"setups": len(rows), **_current(rows, in_scope)}
    out["out_of_scope"] = _current(rows, lambda row: not in_scope(row))
    out["fitted"] = _current(rows, fitted)
    out["fitted_first"] = _first(rows, fitted)
    out["held_out"] = _current(rows, held_out)
    out["held_out_first"] = _first(rows, held_out)
    out["new_first"] = _first(
        rows, lambda row: in_scope(row) and FIRST_PREDICTIONS.get(row["name"], (0, ""))[1] == FIRST_ISSUE38
    )
    out["new_now"] = _current(
        rows, lambda row: in_scope(row) and FIRST_PREDICTIONS.get(row["name"], (0, ""))[1] == FIRST_ISSUE38
    )
    out["free_plans_on_a_bound"] = sum(on_bound(free) for free in frees)
    out["free_speedups_explained"] = sum(1 for row in rows if row.get("free_speedup", 0) > EXPLAIN_SPEEDUP)
    out["peer_speedups"] = _speedups(peers)
    out["checks"] = issue_checks(rows, EXPLAIN_SPEEDUP)
    return out


def stats_text(stats: dict) -> str:
    """One class's figures in words."""
    if not stats.get("compared"):
        return "none compared"
    return (
        f"{stats['compared']} compared, median |ratio - 1| {stats['median_abs_error']:.1%}, max "
        f"{stats['max_abs_error']:.1%}, {stats['within_10pct']} within 10%, {stats['beyond_25pct']} beyond 25%"
    )


def speedups_text(stats: dict) -> str:
    """The free plans' predicted speed-ups over the peers' configurations, in words."""
    if not stats.get("compared"):
        return "none"
    return (
        f"{stats['compared']} rows, median {stats['median']:.2f}x, range {stats['min']:.2f}-{stats['max']:.2f}x, "
        f"{stats['over_1_2']} over 1.2x"
    )


def summary_text(s: dict) -> list[str]:
    """The summary paragraphs of the report."""
    return [
        f"Setups: {s['setups']}. **In scope**: {stats_text(s)}. Out of scope (marked `f`: the published window "
        f"includes the run's first step; `2`: the source prints the figure twice for different runs; left out of "
        f"every other figure): {stats_text(s['out_of_scope'])}.",
        "",
        f"**Fitted** (rows of the tables the presets' rates were fitted to): now {stats_text(s['fitted'])}; first "
        f"recorded predictions {stats_text(s['fitted_first'])}. **Held out** (marked `h`): now "
        f"{stats_text(s['held_out'])}; first recorded predictions {stats_text(s['held_out_first'])} (where each "
        "first prediction is recorded: `scripts/published_first.py`; the held-out rows' current figures were "
        "looked at by later changes, their first ones were not).",
        "",
        f"**New rows** (issue 38: added and predicted before any change looked at them): first predictions "
        f"{stats_text(s.get('new_first', {}))}; now {stats_text(s.get('new_now', {}))}.",
        "",
        f"Free plans whose predicted step sits on a plausibility bound: {s['free_plans_on_a_bound']}. Free plans' "
        f"predicted speed-up over what Megatron-LM, torchtitan and llm-foundry ran: "
        f"{speedups_text(s['peer_speedups'])}. Free plans over {EXPLAIN_SPEEDUP}x the pinned one: "
        f"{s['free_speedups_explained']} (reasons below the table).",
    ]
