"""What the pinned llm-foundry rows would predict if their FSDP traffic were not hidden (issue 38, a diagnosis).

The model overlaps a plan's parameter all-gathers and gradient reduce-scatters with its compute. The
uncheckpointed llm-foundry rows run at small micro-batches, so their per-micro-batch traffic is a larger
share of the step, and the model over-predicts them. This reads ``benchmarks/results/published.json`` and
prints, per llm-foundry row, the pinned ratio with that traffic added to the step instead: all-gathers at
fp32 width where the table's mixed precision is DEFAULT (Composer of the time gathered fp32 parameters),
at the plan's bf16 width for the PURE table (A100 40GB). Nothing in the model changes.

    python scripts/published_fsdp_traffic.py
"""

from __future__ import annotations

import json

from elixir_tune import paths

# The all-gathers' width over the plan's bf16, per source family (Composer's MixedPrecision of the tables).
GATHER_WIDTH = {"llm-foundry": 2.0, "llm-foundry-40gb": 1.0}


def exposed_ratio(row: dict) -> float:
    """The row's pinned ratio with its all-gathers (at the peer's width) and reduce-scatters added to the step."""
    pinned = row["pinned"]
    breakdown = pinned["breakdown"]
    traffic_s = GATHER_WIDTH[row["source_key"]] * breakdown.get("allgather_s", 0.0) + breakdown.get(
        "reduce_scatter_s", 0.0
    )
    return row["ratio"] * pinned["step_time_s"] / (pinned["step_time_s"] + traffic_s)


def main() -> None:
    report = json.loads((paths.REPO_DIR / "benchmarks" / "results" / "published.json").read_text())
    print("| setup | micro-batch | checkpointing | pinned ratio | with the traffic exposed |")
    print("|---|---:|---|---:|---:|")
    for row in report["rows"]:
        if row["source_key"] in GATHER_WIDTH and "ratio" in row:
            print(
                f"| {row['name']} | {row['micro_batch_size']} | {row['checkpointing']} | {row['ratio']:.3f} "
                f"| {exposed_ratio(row):.3f} |"
            )


if __name__ == "__main__":
    main()
