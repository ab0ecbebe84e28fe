"""Issue 23's checks over the published table's rows (scripts/bench_published.py): the plausibility bound
and the reasons for large free speed-ups.

A row's free plan carries the plausibility bounds its step was scored against in its breakdown
(``bound_compute_s``, ``bound_pcie_s``, ``bound_cpu_adam_s``: ``costmodel.rates.plausibility_bound``). The
bound is a check, not a clamp (issue 38): a step below it is a defect of the model, kept as predicted
and counted here. These checks read the rows as written.
"""

from __future__ import annotations

from elixir_tune.costmodel.rates import BOUND_KEYS

# A clamped step equals its bound up to the rounding of the report's breakdown (6 decimals).
BOUND_TOLERANCE_S = 1e-5


def bound_status(result: dict) -> str:
    """Where one plan's predicted step stands against its plausibility bound.

    Args:
        result: a ``best_plan`` entry (``step_time_s`` and ``breakdown``), or an ``{"error": ...}`` entry.

    Returns:
        ``"no plan"``; ``"none applies"`` when every bound is 0 (a preset with no best published MFU
        and nothing offloaded); ``"above"`` when the step is shorter than its largest bound, i.e. the
        plan is predicted faster than the bound allows; else ``"within"``.
    """
    if "breakdown" not in result:
        return "no plan"
    bound_s = max(result["breakdown"].get(key, 0.0) for key in BOUND_KEYS)
    if bound_s <= 0:
        return "none applies"
    return "above" if result["step_time_s"] < bound_s - BOUND_TOLERANCE_S else "within"


def issue_checks(rows: list[dict], explain_speedup: float) -> dict:
    """The names of the rows that fail or escape issue 23's checks.

    Args:
        rows: the report's rows (``run_setup`` entries).
        explain_speedup: the free speed-up above which a row must give its reason.

    Returns:
        ``free_above_bound``: free plans predicted faster than their bound; ``free_without_bound``:
        free plans no bound applies to; ``speedups_without_reason``: free speed-ups over
        ``explain_speedup`` with no ``speedup_reason``.
    """
    return {
        "free_above_bound": [row["name"] for row in rows if bound_status(row["free"]) == "above"],
        "free_without_bound": [row["name"] for row in rows if bound_status(row["free"]) == "none applies"],
        "speedups_without_reason": [
            row["name"]
            for row in rows
            if row.get("free_speedup", 0) > explain_speedup and not row.get("speedup_reason")
        ],
    }


def checks_text(checks: dict, explain_speedup: float) -> str:
    """The checks as one paragraph of the report."""

    def named(names: list[str]) -> str:
        return f"{len(names)}" + (f" ({'; '.join(names)})" if names else "")

    return (
        f"Issue 23's checks: free plans predicted faster than their plausibility bound: "
        f"{named(checks['free_above_bound'])}; free plans no bound applies to (a preset with no published best "
        f"MFU, nothing offloaded): {named(checks['free_without_bound'])}; free plans over {explain_speedup}x the "
        f"pinned one without their reason: {named(checks['speedups_without_reason'])}."
    )
