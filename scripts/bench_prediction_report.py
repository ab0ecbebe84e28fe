"""Formatting for scripts/bench_prediction.py: the markdown table, rank correlation, units."""

from __future__ import annotations

import statistics


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f}"


def rank_order(values: list[float]) -> list[int]:
    """1-based rank of each value (ties share the lower rank)."""
    return [1 + sum(v < x for v in values) for x in values]


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = rank_order(a), rank_order(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else float("nan")


def run_spread_s(round_medians_s: list[float]) -> float:
    """A shape's run-to-run spread: its largest run median less its smallest (0 with one run)."""
    return max(round_medians_s) - min(round_medians_s) if round_medians_s else 0.0


def near_ties(medians_s: dict[str, float], spreads_s: dict[str, float]) -> dict[str, list[str]]:
    """Which shapes the measurement cannot order: two shapes are a near tie when their medians differ by
    no more than the larger of their run-to-run spreads (``run_spread_s``).

    Args:
        medians_s: shape -> measured median step (seconds).
        spreads_s: shape -> its run-to-run spread (seconds).

    Returns:
        shape -> the other shapes it is a near tie with, in measured order.
    """
    names = sorted(medians_s, key=lambda name: medians_s[name])
    return {
        a: [b for b in names if b != a and abs(medians_s[a] - medians_s[b]) <= max(spreads_s[a], spreads_s[b])]
        for a in names
    }


def tie_aware_order(medians_s: dict[str, float], ties: dict[str, list[str]]) -> list[list[str]]:
    """The measured order with near ties grouped: shapes sorted by median, a shape joining the group before
    it when it is a near tie with any shape of that group."""
    groups: list[list[str]] = []
    for name in sorted(medians_s, key=lambda name: medians_s[name]):
        if groups and any(other in ties[name] for other in groups[-1]):
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


def order_agrees(predicted_s: dict[str, float], groups: list[list[str]]) -> bool:
    """Whether the prediction orders every two shapes of different groups (``tie_aware_order``) as measured."""
    rank = {name: index for index, group in enumerate(groups) for name in group}
    return all(
        (predicted_s[a] < predicted_s[b]) == (rank[a] < rank[b]) for a in rank for b in rank if rank[a] != rank[b]
    )


def format_order(groups: list[list[str]]) -> str:
    """``a ≈ b < c``."""
    return " < ".join(" ≈ ".join(group) for group in groups)


def tie_ranking(rows: list[dict]) -> dict:
    """The orders of the shapes (``bench_prediction.py``'s rows): predicted, measured strictly (by the
    pooled medians) and measured with near ties grouped (``near_ties``, from each shape's run-to-run
    spread), and whether the prediction agrees with each. Adds ``run_spread_s`` and ``near_ties`` to
    every row."""
    medians = {r["name"]: r["measured_median_step_time_s"] for r in rows}
    spreads = {r["name"]: run_spread_s(r["measured"]["round_medians_s"]) for r in rows}
    predicted = {r["name"]: r["predicted_step_time_s"] for r in rows}
    ties = near_ties(medians, spreads)
    for row in rows:
        row["run_spread_s"], row["near_ties"] = spreads[row["name"]], ties[row["name"]]
    strict = [[name] for name in sorted(medians, key=lambda name: medians[name])]
    grouped = tie_aware_order(medians, ties)
    return {
        "predicted_order": format_order([[name] for name in sorted(predicted, key=lambda name: predicted[name])]),
        "measured_order_strict": format_order(strict),
        "measured_order_tie_aware": format_order(grouped),
        "agree_strict": order_agrees(predicted, strict),
        "agree_tie_aware": order_agrees(predicted, grouped),
    }


def tie_cell(row: dict) -> str:
    """The 'near tie' cell: the shapes this one cannot be told from, and its run-to-run spread."""
    if "run_spread_s" not in row:
        return "-"
    spread = f"{ms(row['run_spread_s'])} ms, {row['run_spread_s'] / row['measured_median_step_time_s']:.0%}"
    return f"{' ≈ '.join(row['near_ties']) or 'none'} ({spread})"


def describe(shape: dict) -> str:
    layout = "".join(f"{key} {shape[key]}, " for key in ("pipeline", "tensor") if shape.get(key, 1) > 1)
    return layout + (
        f"mb {shape['micro_batch_size']}x{shape['grad_accum_steps']}, ckpt {shape['checkpointing']}, "
        f"cache {shape['cache_blocks']}/{shape['cacheable_chunks']}, pf {shape['prefetch']}, "
        f"offload {shape['offloaded_chunks']}/{shape['num_chunks']}"
    )


def speed_note(record: dict) -> str:
    """`` Timed just before each run, ...``: how the machine's own speed moved over the runs (the plain
    forward+backward the bench times before each run), or "" for a record without it."""
    times = [
        run["plain_fwd_bwd_8x1_before_s"]
        for row in record["shapes"]
        for run in row["measured"]["runs"]
        if "plain_fwd_bwd_8x1_before_s" in run
    ]
    if not times:
        return ""
    return (
        f" Timed just before each of the {len(times)} runs, the micro-batch 8 forward+backward took "
        f"{ms(min(times))}-{ms(max(times))} ms (median {ms(statistics.median(times))}): the machine's own "
        "speed over the runs, which moves measured/predicted with no error of the model."
    )


def markdown(record: dict) -> str:
    hw = record["hardware"]
    lines = [
        "# Cost-model prediction vs measurement, CPU",
        "",
        f"- device: cpu ({record['cpu']}, {record['cores']} cores), torch {record['torch']}, "
        f"python {record['python']}, {record['date_utc']} UTC",
        f"- command: `.venv/bin/python {record['command'].strip()}` ({record['elapsed_s']} s)",
        f"- model: GPT-2 n_embd {record['model']['hidden']}, {record['model']['layers']} layers, "
        f"{record['model']['heads']} heads, vocab {record['model']['vocab']}, seq {record['model']['seq']} "
        f"({record['model']['num_params']:,} parameters), fp32, AdamW; world {record['world_size']} (gloo), "
        f"global batch {record['global_batch_size']}",
        f"- hardware ({record['hardware_source']}): fp32 matmul {hw['matmul_tflops'].get('fp32'):.3g} TFLOP/s, "
        f"all-gather {hw['allgather_gbps']:.3g} GB/s, reduce-scatter {hw['reduce_scatter_gbps']:.3g} GB/s, "
        f"collective latency {hw['collective_latency_s'] * 1e6:.0f} us, Adam {hw['cpu_adam_elems_per_s']:.2e} elem/s",
        "- compute rate the cost model uses: the probe's transformer-block forward+backward curve, fp32 "
        + ", ".join(
            f"{tflops:.3g} TFLOP/s at {numel / 1e6:.3g}M block parameters"
            for numel, tflops in sorted((hw.get("block_tflops_curves") or {}).get("fp32", {}).items())
        )
        + " (read at the model's block parameter count), net of a block call's overhead "
        f"({hw.get('block_call_overhead_s', 0) * 1e3:.2f} ms) and of its pointwise ops; the model's pointwise ops "
        f"({record['model'].get('pointwise_bytes_per_sample', 0) / 1e6:.2f} MB written per sample) at "
        f"{hw.get('pointwise_gbps', 0):.3g} GB/s; a thread hand-over of layered accumulation "
        f"{hw.get('thread_handoff_s', 0) * 1e6:.0f} us",
        f"- layout costs on the CPU: a tensor-split block {hw.get('tensor2_block_fixed_s', 0) * 1e3:.2f} ms + "
        f"{hw.get('tensor2_block_extra_ratio', 0):.3g} x the whole block's time per micro-batch; a pipeline "
        f"{hw.get('pipeline_stage_microbatch_s', 0) * 1e3:.2f} ms per virtual stage and micro-batch + "
        f"{hw.get('pipeline_microbatch_extra_ratio', 0):.3g} x the stage's compute",
        *(f"- {key}: {how}" for key, how in record.get("layout_cost_sources", {}).items()),
        f"- load: 1-minute load average {record['load_avg_1min_at_start']} at the start, "
        f"{record['load_avg_1min_at_end']} at the end (2 cores, shared with other jobs)",
        f"- measured: `elixir-run plan.yaml train_gpt2.py --synthetic --steps {record['steps']}` (rank 0 "
        f"`step_time_s`), {record['rounds']} runs per shape in alternating order; median over the timed steps "
        f"of all runs after dropping {record['warmup']} warm-up steps of each (each run's median in the JSON)",
        "",
        "| shape | choices | predicted ms | measured ms (min-max) | per-run medians ms | measured / predicted "
        "| rank pred / meas | near tie (run spread) | model states = engine | predicted worker MiB "
        "| measured RSS growth MiB (peak RSS) |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for r in record["shapes"]:
        m = r["measured"]
        growth = "/".join(mib(g) for g in r["measured_rss_growth_bytes_per_rank"])
        peak = "/".join(mib(g) for g in r["measured_peak_rss_bytes_per_rank"])
        # Pipeline stages hold different chunks: each rank's own promise (older records: the plan's one figure).
        per_rank = r.get("predicted_worker_bytes_per_rank") or [r["predicted_worker_bytes"]]
        worker = "/".join(mib(b) for b in per_rank) if len(set(per_rank)) > 1 else mib(per_rank[0])
        lines.append(
            f"| {r['name']} | {describe(r['shape'])} | {ms(r['predicted_step_time_s'])} | "
            f"{ms(r['measured_median_step_time_s'])} ({ms(m['min_step_time_s'])}-{ms(m['max_step_time_s'])}) | "
            f"{', '.join(ms(t) for t in m['round_medians_s'])} | {r['ratio_measured_over_predicted']:.2f} | "
            f"{r['predicted_rank']} / {r['measured_rank']} | {tie_cell(r)} | "
            f"{'yes' if r['model_state_bytes_match'] else 'NO'} | {worker} | "
            f"{growth} ({peak}) |"
        )
    rk = record["ranking"]
    plain = record["plain_pytorch_1thread"]
    lines += [
        "",
        f"Ranking: predicted fastest {', '.join(rk['predicted_fastest'])}; measured fastest {rk['measured_fastest']}; "
        f"agree: {'yes' if rk['agree'] else 'no'}; Spearman rank correlation {rk['spearman']} (by the minimum "
        f"step time: fastest {rk['measured_fastest_by_min']}, Spearman {rk['spearman_by_min']}).",
        *(
            [
                "",
                f"Order: predicted {rk['predicted_order']}; measured, strict (pooled medians) "
                f"{rk['measured_order_strict']}: {'agrees' if rk['agree_strict'] else 'DIFFERS'}; measured, "
                f"tie-aware {rk['measured_order_tie_aware']}: {'agrees' if rk['agree_tie_aware'] else 'DIFFERS'} "
                "(≈: a near tie, medians apart by no more than the larger of the two shapes' run-to-run "
                "spreads, the largest per-run median less the smallest; the tie-aware order asks the "
                "prediction to order only shapes the measurement orders).",
            ]
            if "measured_order_strict" in rk
            else []
        ),
        "",
        "Predicted breakdown (ms):",
        "",
        "| shape | compute | recompute | all-gather | reduce-scatter | exposed fetch | grad drain | optimizer exposed "
        "| thread hand-overs | no-overlap sum | measured / no-overlap sum |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in record["shapes"]:
        b = r["predicted_breakdown"]
        lines.append(
            f"| {r['name']} | {ms(b.get('compute_s', 0))} | {ms(b.get('recompute_s', 0))} | "
            f"{ms(b.get('allgather_s', 0))} | {ms(b.get('reduce_scatter_s', 0))} | "
            f"{ms(b.get('exposed_fetch_s', 0))} | {ms(b.get('grad_drain_s', 0))} | "
            f"{ms(b.get('optimizer_exposed_s', 0))} | {ms(b.get('thread_handoff_s', 0))} | {ms(r['no_overlap_sum_s'])} | "
            f"{r['measured_median_step_time_s'] / r['no_overlap_sum_s']:.2f} |"
        )
    w1 = record["world1_engine_reference"]
    lines += [
        "",
        "(compute includes recompute and the model's pointwise ops at the probe's pointwise rate; 'thread "
        "hand-overs' are layered accumulation's; 'no-overlap sum' adds compute, all-gather, reduce-scatter, host "
        "copies, the optimizer step and the hand-overs as if none of them overlapped: a diagnostic, not a cost-model "
        "output.)",
        "",
        f"World-1 engine reference (no gloo peer, OMP_NUM_THREADS=1, {describe(w1['shape'])}): predicted "
        f"{ms(w1['predicted_step_time_s'])} ms, measured median {ms(w1['measured_median_step_time_s'])} ms "
        f"(min {ms(w1['measured']['min_step_time_s'])}); predicted worker memory {mib(w1['predicted_worker_bytes'])} MiB, "
        f"measured RSS growth {mib(w1['measured_rss_growth_bytes'])} MiB; model states = engine: "
        f"{'yes' if w1['model_state_bytes_match'] else 'NO'}.",
        "",
        f"Plain PyTorch reference (no engine, 1 thread, this process alone): forward+backward micro-batch 8 "
        f"{ms(plain['fwd_bwd_8x1_s'])} ms, 4 x micro-batch 2 {ms(plain['fwd_bwd_2x4_s'])} ms, AdamW step "
        f"{ms(plain['adamw_step_s'])} ms ({plain['num_modules']} modules, {plain['num_param_tensors']} "
        f"parameter tensors); after the runs: {ms(record['plain_pytorch_1thread_after']['fwd_bwd_8x1_s'])} ms / "
        f"{ms(record['plain_pytorch_1thread_after']['fwd_bwd_2x4_s'])} ms. The machine is shared: 1-minute load "
        f"average {record['load_avg_1min_at_start']} at the start; per shape in the JSON.{speed_note(record)}",
        "",
        (
            f"Plain PyTorch memory (fresh process, 1 thread, micro-batch {record['plain_pytorch_rss']['micro_batch_size']}, "
            f"3 AdamW steps): peak RSS growth {mib(record['plain_pytorch_rss']['growth_bytes'])} MiB against "
            f"{mib(record['plain_pytorch_rss']['predicted_bytes'])} MiB from the profile (activations "
            f"{mib(record['plain_pytorch_rss']['profile_activation_bytes'])} + 16 B per parameter "
            f"{mib(record['plain_pytorch_rss']['param_grad_adam_bytes'])})."
        )
        if "growth_bytes" in record["plain_pytorch_rss"]
        else "Plain PyTorch memory: failed (see JSON).",
        "",
        "Memory columns: 'model states = engine' compares each rank's promised `model_state_bytes` and "
        "`transient_bytes` (`plan.rank_memory(rank)`: its pipeline stage's entry of `prediction.stages`, the "
        "prediction's own figures without a pipeline) with that rank's `model.memory_report()` (world 2, the same "
        "plan); 'predicted worker' is `peak_gpu_bytes + peak_host_bytes / 2` of each rank's promise, rank 0 / rank 1 "
        "where they differ (on the CPU device and host are the same RAM); 'RSS growth' is "
        "each rank's peak RSS (`ru_maxrss`) minus its RSS just before `elixir_tune.setup` (torch, transformers "
        "and the freshly built model already loaded), rank 0 / rank 1.",
        "",
    ]
    return "\n".join(lines)
