"""Predicted tokens/s against the micro-batch size: Llama-2 7B on 8 x h100-80gb-sxm (issue 38).

For each sequence length and micro-batch size the search runs with the micro-batch, the layout
(data parallelism only) and the checkpointing pinned, everything else free, at 16 samples per GPU
per step. Each prediction is made twice: with the preset's GEMM wave model
(``costmodel/gemm_waves.py``, over its ``sm_count``) and without it (``sm_count`` 0: the rate of
the block curve whatever the tokens), so the table shows what the mechanism moves. Nothing runs on
a GPU. No published micro-batch sweep of Llama-2 7B on H100 was found; llm-foundry's sweep of MPT-7b and
13b on 8 x A100 80GB (``published_micro_batch_sweep.py``) is set beside it, published against predicted.

    python scripts/bench_micro_batch.py        # benchmarks/results/micro-batch.{json,md}
"""

from __future__ import annotations

import dataclasses
import json
import time

from published_micro_batch_sweep import SOURCE as SWEEP_SOURCE
from published_micro_batch_sweep import sweep_lines
from report_meta import generated, header_line, load_average

from elixir_tune import paths
from elixir_tune.costmodel.gemm_waves import micro_batch_rate_factor
from elixir_tune.hardware import load_hardware
from elixir_tune.profiler import profile_model
from elixir_tune.search import InfeasibleError, search

COMMAND = "python scripts/bench_micro_batch.py"
HARDWARE = "h100-80gb-sxm"
GPUS = 8
SAMPLES_PER_GPU = 16
SEQ_LENS = (2048, 4096)
MICRO_BATCHES = (1, 2, 4, 8, 16)
CHECKPOINTING = ("none", "all")


def predict(profile, hardware, micro: int, checkpointing: str) -> dict:
    """The best plan at one pinned micro-batch and checkpointing (``{"error": ...}`` when none fits)."""
    try:
        result = search(
            profile,
            hardware,
            gpus_per_node=GPUS,
            nodes=1,
            global_batch_size=GPUS * SAMPLES_PER_GPU,
            fixed={
                "dtype": "bf16",
                "micro_batch_size": micro,
                "checkpointing": checkpointing,
                "tensor": 1,
                "pipeline": 1,
                "context": 1,
            },
            loop="forward_backward",
        )
    except InfeasibleError as error:
        return {"error": str(error).split("; try:")[0][:120]}
    best = result.candidates[0]
    return {
        "tokens_per_s_per_gpu": round(best.tokens_per_s / GPUS, 1),
        "mfu": round(best.mfu, 4),
        "peak_gpu_gib": round(best.memory.peak_gpu_bytes / 2**30, 2),
    }


def main() -> None:
    started, load_before = time.perf_counter(), load_average()
    preset = load_hardware(HARDWARE)
    flat = dataclasses.replace(preset, sm_count=0)
    rows = []
    for seq in SEQ_LENS:
        profile = profile_model(
            str(paths.MODEL_CONFIGS_DIR / "llama2-7b.yaml"), batch_size=1, seq_len=seq, dtype="bf16"
        )
        for checkpointing in CHECKPOINTING:
            for micro in MICRO_BATCHES:
                rows.append(
                    {
                        "seq_len": seq,
                        "checkpointing": checkpointing,
                        "micro_batch_size": micro,
                        "wave_factor": round(micro_batch_rate_factor(profile, micro, 1, preset.sm_count), 4),
                        "with_waves": predict(profile, preset, micro, checkpointing),
                        "without_waves": predict(profile, flat, micro, checkpointing),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    report = {
        "command": COMMAND,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "generated": generated(load_before),
        "rows": rows,
        "published_sweep": [
            {"size": sweep.size, "micro_batch_size": micro, "published_mfu": published, "predicted_mfu": round(mfu, 4)}
            for sweep in sweep_lines()
            for micro, published, mfu in sweep.rows
        ],
    }
    prefix = paths.REPO_DIR / "benchmarks" / "results" / "micro-batch"
    prefix.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    prefix.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {prefix}.json and {prefix}.md")


def _cell(result: dict) -> str:
    if "error" in result:
        return "does not fit"
    return f"{result['tokens_per_s_per_gpu']:.0f} ({result['mfu']:.3f}, {result['peak_gpu_gib']} GiB)"


def markdown(report: dict) -> str:
    """The report as a markdown table."""
    g = report["generated"]
    lines = [
        "# Predicted tokens/s against the micro-batch size: Llama-2 7B on 8 x h100-80gb-sxm",
        "",
        f"{header_line(g)} Command: `{report['command']}` "
        f"({report['elapsed_s']} s). Predictions only (nothing ran on a GPU): data parallelism over 8 GPUs, "
        f"{SAMPLES_PER_GPU} samples per GPU per step, micro-batch and checkpointing pinned, chunks, cache and "
        "prefetch searched. Each cell: tokens/s per GPU (MFU, predicted peak).",
        "",
        "`wave factor`: the block rate at that micro-batch over the curve's (`costmodel/gemm_waves.py`: the "
        "GEMMs' last wave of tiles on 132 SMs). `with waves`: the model as it is; `without`: the same with the "
        "preset's `sm_count` set to 0, the block rate independent of the micro-batch. The micro-batch also sets how "
        "often the chunks a plan does not cache are gathered again, each second of it costing the compute "
        "`collective_compute_loss` seconds.",
        "",
        *table_lines(report),
        "",
        *published_sweep_text(report),
        "",
    ]
    return "\n".join(lines)


def published_sweep_text(report: dict) -> list[str]:
    """The published micro-batch sweep set beside the predicted one (none for Llama-2 7B on H100)."""
    lines = [
        "Published micro-batch sweep: none found for Llama-2 7B on H100 (llm-foundry's MPT-7b H100 rows change the "
        "sequence length with the micro-batch; NVIDIA's Megatron-Bridge/NeMo H100 rows run FP8). The nearest: "
        f"{SWEEP_SOURCE}, MPT-7b and 13b at seq 2048 on 8 x A100 80GB, FULL_SHARD with fp32 gathers, accumulation "
        "2, no checkpointing, only the micro-batch changing; predicted with that configuration pinned. The presets' "
        "`collective_compute_loss` and `recompute_speedup` are fitted to it (`scripts/published_overlap_fit.py`), "
        "so it shows the model's shape, not an independent check.",
        "",
        "| model | micro-batch | published MFU | predicted MFU |",
        "|---|---:|---:|---:|",
    ]
    for row in report.get("published_sweep", []):
        lines.append(
            f"| MPT-{row['size']} | {row['micro_batch_size']} | {row['published_mfu']:.4f} | {row['predicted_mfu']:.4f} |"
        )
    return lines


def table_lines(report: dict) -> list[str]:
    """The sweep's table rows (also written into benchmarks/results/published.md)."""
    lines = [
        "| seq | checkpointing | micro-batch | wave factor | with waves | without |",
        "|---:|---|---:|---:|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['seq_len']} | {row['checkpointing']} | {row['micro_batch_size']} | {row['wave_factor']:.3f} "
            f"| {_cell(row['with_waves'])} | {_cell(row['without_waves'])} |"
        )
    return lines


if __name__ == "__main__":
    main()
