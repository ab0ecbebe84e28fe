"""Selective activation checkpointing against torchtitan's published runs: predicted peak memory and
tokens/s per GPU of each pinned configuration, and how the checkpointing choices rank against each
other where torchtitan ran several on one model.

Each row is a torchtitan run (its source below): model, GPUs, local batch, sequence and the
checkpointing it ran ("selective op" is torchtitan's op-level policy, the plan's ``mode: selective``;
"selective layer" checkpoints every 2nd block fully, torchtitan's default ``selective_ac_option = 2``;
"full" every block; "no" none). For each, the joint search runs pinned to that configuration on the
matching preset (``bench_published.pinned_choices``; nothing offloaded is pinned, the search finds none
needed or says what it had to do), with the device limit lifted where nothing fits (then the row says
the configuration is refused). Nothing runs on a GPU: these are the cost model's predictions.

    python scripts/bench_selective.py          # benchmarks/results/selective-checkpointing.{json,md}
    python scripts/bench_selective.py --out-prefix /tmp/selective
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench_published import best_plan, pinned_choices, profile_of
from published_peer_models import card_memory, fused_norm_profile
from published_setups import H100_96GB_BYTES, TORCHTITAN, Setup
from report_meta import generated

from elixir_tune import paths

PERFORMANCE_MD = (
    "pytorch/torchtitan docs/performance.md @ 041336434916bdc0f88c1f89fda176fd3c2092e4, table '{table}' "
    "(64 A100 80GB, FSDP2, bf16)"
)
# torchtitan's checkpointing names -> the search pin.
CHECKPOINTING = {"selective op": "selective", "selective layer": "every:2", "full": "all", "no": "none"}


def _row(model: str, label: str, nodes: int, seq: int, batch: int, ac: str, tps: float, **extra) -> dict:
    # norm: the run's norm_type (train_configs/<model>.toml at the source's commit): llama2_13b and llama3_8b
    # at 0413364 say "fused_rmsnorm", llama2_70b at 0413364 and llama3_8b at 9dec370 say "rmsnorm".
    extra.setdefault("norm", "rmsnorm")
    return dict(model=model, label=label, nodes=nodes, seq=seq, batch=batch, ac=ac, tokens_per_s_per_gpu=tps, **extra)


FUSED = {"norm": "fused_rmsnorm"}


# (model YAML, label, nodes of 8, seq, local batch, checkpointing, published tokens/s/GPU, measured GiB or
# OOM). torchtitan's 64 x A100 rows, then its Llama-3.1 8B H100 rows (96 GB cards, memory measured).
ROWS = [
    _row("llama2-13b", "Llama-2 13B", 8, 4096, 2, "no", 2162, table="Llama 2 performance numbers", **FUSED),
    _row(
        "llama2-13b", "Llama-2 13B", 8, 4096, 2, "selective layer", 1914, table="Llama 2 performance numbers", **FUSED
    ),
    _row("llama2-13b", "Llama-2 13B", 8, 4096, 2, "selective op", 1904, table="Llama 2 performance numbers", **FUSED),
    _row("llama2-70b", "Llama-2 70B", 8, 4096, 1, "selective op", 355, table="Llama 2 performance numbers"),
    _row("llama2-70b", "Llama-2 70B", 8, 4096, 2, "full", 353, table="Llama 2 performance numbers"),
    # Footnote 1 of the same table: "70B training with local batch size 2 will cause an OOM error when
    # selective activation checkpointing is used".
    _row("llama2-70b", "Llama-2 70B", 8, 4096, 2, "selective op", 0, table="Llama 2 performance numbers", oom=True),
    _row("llama3-8b", "Llama-3 8B", 8, 8192, 1, "selective layer", 2904, table="Llama 3 performance numbers", **FUSED),
    _row("llama3-8b", "Llama-3 8B", 8, 8192, 1, "selective op", 2973, table="Llama 3 performance numbers", **FUSED),
    _row("llama3-8b", "Llama-3.1 8B", 1, 8192, 2, "selective op", 5762, h100="Table 1, row 'FSDP'", measured_gib=82.4),
    _row("llama3-8b", "Llama-3.1 8B", 16, 8192, 2, "selective op", 5605, h100="Table 3, row 'FSDP'", measured_gib=67.0),
]


def setup_of(row: dict) -> Setup:
    h100 = "h100" in row
    source = TORCHTITAN.format(table=row["h100"]) if h100 else PERFORMANCE_MD.format(table=row["table"])
    return Setup(
        name=f"{row['label']} s{row['seq']} b{row['batch']} {row['nodes'] * 8}x{'H100' if h100 else 'A100'} "
        f"({row['ac']})",
        source=source,
        source_key="torchtitan",
        row=f"local batch {row['batch']}, {row['ac']} AC, {row['tokens_per_s_per_gpu'] or 'OOM'} WPS",
        model=row["model"],
        hardware="h100-80gb-sxm" if h100 else "a100-80gb-sxm",
        gpus_per_node=8,
        nodes=row["nodes"],
        seq_len=row["seq"],
        micro_batch_size=row["batch"],
        grad_accum_steps=1,
        checkpointing=CHECKPOINTING[row["ac"]],
        tokens_per_s_per_gpu=float(row["tokens_per_s_per_gpu"]),
        offload=0.0,
    )


def row_profile(row: dict, setup: Setup):
    """The row's model as torchtitan built it: transformers' Llama, with the fused norm where the run had it
    (``published_peer_llama``)."""
    if row["norm"] == "fused_rmsnorm":
        return fused_norm_profile(setup.model, setup.seq_len, setup.dtype, "none")
    return profile_of(setup)


def run_row(row: dict) -> dict:
    setup = setup_of(row)
    started = time.perf_counter()
    hardware = card_memory(setup.hardware, H100_96GB_BYTES) if "h100" in row else None
    result = best_plan(row_profile(row, setup), setup, pinned_choices(setup), lift_memory=True, hardware=hardware)
    out = dict(row, name=setup.name, source=setup.source, hardware=setup.hardware, search_s=0.0)
    out["search_s"] = round(time.perf_counter() - started, 1)
    if "error" in result:
        out["error"] = result["error"]
        return out
    out.update(
        predicted_tokens_per_s_per_gpu=round(result["tokens_per_s_per_gpu"], 1),
        predicted_peak_gib=result["peak_gpu_gib"],
        usable_gib=result["usable_gib"],
        refused=result["over_usable_memory"],
        checkpoint_mode=result["shape"].get("checkpoint_mode", "full"),
        every=result["shape"]["checkpointing"],
        recompute_s=result["breakdown"].get("recompute_s", 0.0),
        step_time_s=round(result["step_time_s"], 4),
    )
    if row["tokens_per_s_per_gpu"]:
        out["ratio"] = round(out["predicted_tokens_per_s_per_gpu"] / row["tokens_per_s_per_gpu"], 3)
    print(f"{setup.name}: {out.get('predicted_peak_gib')} GiB, ratio {out.get('ratio')} ({out['search_s']} s)")
    return out


def relative_rows(rows: list[dict]) -> list[str]:
    """Each checkpointing choice against another of the same model, batch and cluster: published and
    predicted tokens/s ratios (what the recomputation costs, which the absolute rates leave out)."""
    lines = []
    for base in rows:
        for other in rows:
            same = all(base[key] == other[key] for key in ("model", "nodes", "seq", "batch"))
            published_pair = base["tokens_per_s_per_gpu"] and other["tokens_per_s_per_gpu"]
            if not same or base is other or base["ac"] != "selective op" or not published_pair:
                continue
            if "predicted_tokens_per_s_per_gpu" not in base or "predicted_tokens_per_s_per_gpu" not in other:
                continue
            published = base["tokens_per_s_per_gpu"] / other["tokens_per_s_per_gpu"]
            predicted = base["predicted_tokens_per_s_per_gpu"] / other["predicted_tokens_per_s_per_gpu"]
            lines.append(
                f"| {base['label']} b{base['batch']} | selective op / {other['ac']} | {published:.3f} | {predicted:.3f} |"
            )
    return lines


def _names(rows: list[dict], chosen) -> str:
    """The names of the rows ``chosen`` picks among those with a plan, or "none"."""
    return "; ".join(row["name"] for row in rows if "error" not in row and chosen(row)) or "none"


def markdown(report: dict) -> str:
    gen = report["generated"]
    lines = [
        "# Selective activation checkpointing against torchtitan's runs",
        "",
        f"Generated {gen['date']} on {gen['machine']}, commit {gen['commit']}, load average {report['load_average']} "
        f"(shared machine). Command: `python scripts/bench_selective.py`. Predictions of the cost model only, nothing ran "
        "on a GPU. Selective = torchtitan's op-level policy (elixir_tune/selective_checkpoint.py); 'selective layer' "
        "is every 2nd block fully checkpointed (its default option 2).",
        "",
        "Memory: a row fits when its predicted peak is within the usable memory of the cards it ran on. torchtitan's "
        "H100s had 96 GB HBM2e (its 'Hardware' section): those rows take h100-80gb-sxm's rates and 96e9 bytes less "
        "its CUDA context (scripts/published_peer_models.py card_memory), and also compare with the memory measured. "
        "Rows whose torchtitan config says norm_type fused_rmsnorm are profiled with that norm's save set "
        "(published_peer_models.py: transformers' Llama keeps 4 bytes per token and hidden unit more per norm).",
        "",
        f"Ran but refused on its preset: {_names(report['rows'], lambda r: r['refused'] and not r.get('oom'))}. "
        f"Failed (OOM) but predicted to fit: {_names(report['rows'], lambda r: r.get('oom') and not r['refused'])}.",
        "",
        "| run | checkpointing, norm | published tok/s/GPU | predicted | ratio | predicted peak GiB | usable GiB | "
        "fits the preset | measured GiB | predicted / measured |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in report["rows"]:
        if "error" in row:
            lines.append(f"| {row['name']} | {row['ac']} | {row['tokens_per_s_per_gpu']} | no plan: {row['error']} |")
            continue
        published = "OOM" if row.get("oom") else f"{row['tokens_per_s_per_gpu']:.0f}"
        fits = "no (refused)" if row["refused"] else "yes"
        measured = row.get("measured_gib")
        memory_ratio = f"{row['predicted_peak_gib'] / measured:.3f}" if measured else "-"
        lines.append(
            f"| {row['name']} | {row['ac']}, {row['norm']} | {published} | {row['predicted_tokens_per_s_per_gpu']:.0f} | "
            f"{row.get('ratio', '-')} | {row['predicted_peak_gib']} | {row['usable_gib']} | {fits} | "
            f"{row.get('measured_gib', '-')} | {memory_ratio} |"
        )
    lines += [
        "",
        "Selective op against the other choices torchtitan ran on the same model, batch and cluster (tokens/s ratio):",
        "",
        "| model | pair | published | predicted |",
        "|---|---|---:|---:|",
        *report["relative"],
        "",
        "Sources:",
        "",
        *sorted({f"- {row['source']}" for row in report["rows"]}),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out-prefix", default=str(paths.REPO_DIR / "benchmarks" / "results" / "selective-checkpointing")
    )
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows = [run_row(row) for row in ROWS]
    report = {"rows": rows, "relative": relative_rows(rows), "load_average": round(load, 2)}
    report["generated"] = generated(round(load, 2), "python scripts/bench_selective.py")
    prefix = Path(args.out_prefix)
    prefix.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    prefix.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {prefix}.json and {prefix}.md")


if __name__ == "__main__":
    main()
