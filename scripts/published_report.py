"""The markdown of scripts/bench_published.py's report: the table, the checks, the memory checks, the
micro-batch sweep and the sources with their plans and mismatches (written from the stored JSON)."""

from __future__ import annotations

import json

from published_checks import checks_text, issue_checks
from published_left_out import LEFT_OUT
from published_summary import EXPLAIN_SPEEDUP, first_ratio, on_bound, out_of_scope, summary_text

from elixir_tune import paths
from elixir_tune.costmodel.rates import BOUND_KEYS, BOUND_LABELS


def memory_lines(report: dict) -> list[str]:
    """Issue 38's memory checks: every pinned configuration that ran fits its prediction, every one that
    failed is refused."""
    ran = [row for row in report["rows"] if "tokens_per_s_per_gpu" in row["pinned"]]
    over = [row for row in ran if row["pinned"].get("over_usable_memory")]
    lines = [
        "",
        "## Memory checks",
        "",
        f"Pinned configurations that ran: {len(ran)}; predicted over the preset's usable memory (a plan found only "
        f"with the limit lifted): {len(over)}"
        + (
            " ("
            + "; ".join(
                f"{row['name']}: {row['pinned']['peak_gpu_gib']} > {row['pinned']['usable_gib']} GiB" for row in over
            )
            + ")"
            if over
            else ""
        )
        + ".",
    ]
    for check in report.get("failed", []):
        verdict = "refused" if check["refused"] else "NOT refused (a defect of the memory model)"
        lines += [
            "",
            f"Ran out of memory at the source: {check['name']} (`{check['row']}`, {check['source']}): {verdict}; "
            f"predicted peak {check['peak_gpu_gib']} GiB of {check['usable_gib']} GiB usable; plan: {check['plan']}.",
        ]
    return lines


def _plan_text(result: dict) -> str:
    if "error" in result:
        return "no plan: " + result["error"].replace("|", "/")[:120]
    s = result["shape"]
    every = s["checkpointing"]
    ckpt = "none" if every == 0 else "all" if every == 1 else f"1/{every}"
    ckpt += " selective" if s.get("checkpoint_mode") == "selective" else ""
    text = (
        f"{result['layout']}, micro {s['micro_batch_size']}x{s['grad_accum_steps']}"
        f"{' layered' if s['accumulation'] == 'layered' else ''}, ckpt {ckpt}, offload {s['offload']:.0%}, "
        f"cache {s['cache_blocks']}/{s['cacheable_chunks']}, {result['peak_gpu_gib']} GiB"
    )
    if result.get("over_usable_memory"):
        text += f" (the search found it over the preset's {result['usable_gib']} GiB usable: predicted with the limit lifted)"
    breakdown = result["breakdown"]
    bounds = [key for key in BOUND_KEYS if breakdown.get(key, 0) > 0]
    if bounds:
        binding = max(bounds, key=lambda key: breakdown[key])
        where = (
            "DEFECT, predicted faster than"
            if breakdown.get("bound_excess_s", 0) > 0
            else "on"
            if on_bound(result)
            else "below"
        )
        text += f"; {where} bound: {BOUND_LABELS[binding]} ({breakdown[binding]:.3g} s)"
    return text


def table_row(row: dict) -> str:
    """One setup's line of the results table: published, pinned and free figures and the free plan."""

    def figure(result: dict, key: str, spec: str) -> str:
        return format(result[key], spec) if key in result else "-"

    pinned, free = row["pinned"], row["free"]
    first = first_ratio(row)
    raw = f"{first:.2f}" if first is not None else "-"
    scope = out_of_scope(row)
    marks = (
        (" `*`" if row.get("defines_bound") else "")
        + ("" if row.get("fitted_source") else " `h`")
        + (" `f`" if scope.startswith("window") else " `2`" if scope else "")
    )
    speedup = f"{row['free_speedup']:.2f}x" if "free_speedup" in row else "-"
    return (
        f"| {row['name']}{marks} | {row['published_tokens_per_s_per_gpu']:.0f} "
        f"| {figure(pinned, 'tokens_per_s_per_gpu', '.0f')} | {row['ratio']:.2f} | {raw} "
        f"| {figure(pinned, 'mfu', '.3f')} | {figure(free, 'tokens_per_s_per_gpu', '.0f')} | {speedup} "
        f"| {figure(free, 'mfu', '.3f')} | {_plan_text(free)} |"
        if "ratio" in row
        else f"| {row['name']}{marks} | {row['published_tokens_per_s_per_gpu']:.0f} | - | - | - | - | "
        f"{figure(free, 'tokens_per_s_per_gpu', '.0f')} | - | {figure(free, 'mfu', '.3f')} | {_plan_text(free)} |"
    )


def markdown(report: dict) -> str:
    """The report as markdown: summary, one table row per setup, then sources and plans per setup."""
    s = report["summary"]
    lines = [
        "# The cost model against published training throughput",
        "",
        f"Generated {report.get('generated', {}).get('date', '?')} on {report.get('generated', {}).get('machine', '?')}"
        f" at commit {report.get('generated', {}).get('commit', '?')}, load average "
        f"{report.get('generated', {}).get('load_average', '?')} (1, 5, 15 min).",
        "",
        f"Command: `{report['command']}` ({report['elapsed_s']} s). Predictions of the cost model only (nothing ran "
        "on a GPU), against figures quoted from their sources (below each table row's source and the quoted row)."
        + (
            f" Run here as {len(report['parts'])} parts (in parallel or one after another), merged with `--merge`: "
            + "; ".join(f"`{command}`" for command in report["parts"])
            + "."
            if report.get("parts")
            else ""
        ),
        "",
        "**pinned**: the peer's configuration (its tensor and pipeline degrees with data parallelism over the rest, "
        "its micro-batch, accumulation, checkpointing, dtype and offload; mismatches listed per setup). **free**: the "
        "same model, cluster and global batch, everything else searched (pipeline, tensor and layered plans "
        "included). ratio = predicted / published tokens/s per GPU; speed-up = free / pinned predicted tokens/s.",
        "",
        *summary_text(s),
        "",
        checks_text(s.get("checks") or issue_checks(report["rows"], EXPLAIN_SPEEDUP), EXPLAIN_SPEEDUP),
        *memory_lines(report),
        "",
        "`first ratio`: the row's first recorded pinned ratio (`scripts/published_first.py` says where each is "
        "recorded). The plausibility bound is a check, not a clamp: a plan predicted faster than it is marked DEFECT.",
        "",
        "| setup | published tok/s/GPU | pinned tok/s/GPU | ratio | first ratio | pinned MFU | free tok/s/GPU "
        "| speed-up | free MFU | free plan |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines += [table_row(row) for row in report["rows"]]
    explained = [row for row in report["rows"] if row.get("speedup_reason")]
    if explained:
        lines += ["", f"## Free plans over {EXPLAIN_SPEEDUP}x the pinned one", ""]
        lines += [f"- {row['name']} ({row['free_speedup']:.2f}x): {row['speedup_reason']}" for row in explained]
    lines += over_published_lines(report["rows"])
    lines += micro_batch_section()
    lines += ["", "## Sources, quoted rows, pinned plans and mismatches", ""]
    shared = shared_mismatches(report["rows"])
    for key, texts in shared.items():
        lines += [f"Mismatches of every `{key}` row: " + "; ".join(texts) + ".", ""]
    previous_source = ""
    for row in report["rows"]:
        own = [text for text in row["mismatches"] if text not in shared.get(row.get("source_key", ""), [])]
        source, previous_source = (
            "as the setup above" if row["source"] == previous_source else row["source"],
            row["source"],
        )
        lines += [
            f"### {row['name']}",
            "",
            f"- source: {source}",
            f"- quoted: `{row['row']}`",
            f"- pinned plan: {_plan_text(row['pinned'])}",
            f"- free plan: {_plan_text(row['free'])}",
            *(["- mismatches (beside its family's): " + "; ".join(own)] if own else []),
            "",
        ]
    lines += ["## Sources looked at and left out", ""] + [f"- {text}" for text in LEFT_OUT] + [""]
    if report.get("note"):
        lines += ["## Note", "", report["note"], ""]
    return "\n".join(lines)


def micro_batch_section() -> list[str]:
    """Issue 38's micro-batch table (scripts/bench_micro_batch.py's stored report) and the published
    figures beside it; nothing when that report is absent."""
    path = paths.REPO_DIR / "benchmarks" / "results" / "micro-batch.json"
    if not path.is_file():
        return []
    import bench_micro_batch  # deferred: it imports this module

    report = json.loads(path.read_text())
    g = report["generated"]
    return [
        "",
        "## Predicted tokens/s against the micro-batch size: Llama-2 7B on 8 x h100-80gb-sxm",
        "",
        f"From `{report['command']}` ({g['date']}, commit {g['commit']}; benchmarks/results/micro-batch.md says how). "
        "Each cell: tokens/s per GPU (MFU, predicted peak); `without`: the GEMM wave model off.",
        "",
        *bench_micro_batch.table_lines(report),
        "",
        *bench_micro_batch.published_sweep_text(report),
    ]


def over_published(row: dict) -> float:
    """The free plan's predicted tokens/s over what the source ran (0 without both)."""
    free = row["free"].get("tokens_per_s_per_gpu")
    return free / row["published_tokens_per_s_per_gpu"] if free and row["published_tokens_per_s_per_gpu"] else 0.0


def over_published_lines(rows: list[dict]) -> list[str]:
    """Free plans predicted over 1.2x what the source ran, each with its mechanism in one line: the plan
    choices that differ from the peer's (the speed-up reason) and the model's error on the peer's own
    configuration (the pinned ratio), which multiply to it."""
    chosen = [row for row in rows if over_published(row) > EXPLAIN_SPEEDUP and not out_of_scope(row)]
    if not chosen:
        return []
    lines = ["", f"## Free plans predicted over {EXPLAIN_SPEEDUP}x what the source ran", ""]
    for row in chosen:
        speedup = row.get("free_speedup", 1.0)
        why = row.get("speedup_reason") or (
            "the free plan keeps the peer's choices (speed-up under 1.2x): the excess is the model's error on "
            "the peer's own configuration (the pinned ratio)"
        )
        lines.append(
            f"- {row['name']} ({over_published(row):.2f}x = pinned ratio {row['ratio']:.2f} x speed-up {speedup:.2f}): "
            f"{why}"
        )
    return lines


def shared_mismatches(rows: list[dict]) -> dict[str, list[str]]:
    """The mismatches every row of a source family states, per family (written once in the report)."""
    families: dict[str, list[dict]] = {}
    for row in rows:
        families.setdefault(row.get("source_key", ""), []).append(row)
    shared = {}
    for key, members in families.items():
        common = [text for text in members[0]["mismatches"] if all(text in row["mismatches"] for row in members)]
        if common:
            shared[key] = common
    return shared
