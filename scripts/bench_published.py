"""The cost model against published training throughput: predicted vs published tokens/s per GPU.

Each setup is a published measurement (``PUBLISHED`` below: its source, the exact figure and the
configuration it ran). For each, the joint search runs twice on the matching hardware preset:

* pinned: the peer's configuration as closely as a plan can express it (data parallelism over every
  GPU, the peer's micro-batch, accumulation, checkpointing and dtype, no offload); what a plan
  cannot express is listed as the setup's mismatches;
* free: the same model, cluster and global batch, everything else left to the search.

The report gives the pinned prediction over the published figure, and the free plan's predicted
speed-up over the pinned one. Nothing runs on a GPU: these are predictions of the cost model
(docs/DESIGN.md section 6) set against figures quoted from their sources.

    python scripts/bench_published.py                 # writes benchmarks/results/published.{json,md}
    python scripts/bench_published.py --out-prefix benchmarks/results/published-before
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from elixir_tune import paths
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware

try:  # the bound's names (absent from the cost model before it had the bound)
    from elixir_tune.costmodel.rates import BOUND_KEYS, BOUND_LABELS
except ImportError:
    BOUND_KEYS, BOUND_LABELS = (), {}
from elixir_tune.profiler.schema import ModelProfile
from elixir_tune.search import InfeasibleError, search

COMMAND = "python scripts/bench_published.py"
LLM_FOUNDRY = (
    "mosaicml/llm-foundry scripts/train/benchmarking/README.md @ 8c8dd48f72168c5d51e2f7b151595892a8fba43d "
    "(2025-07-21), table '{table}'"
)
TORCHTITAN = (
    "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ b5bcd76c66d0acb1a08b176d9639425bc55e0b2a "
    "(torchtitan 9dec370, 2024-12-26), {table}"
)
H100_TABLE = "H100 80GB BF16"
A100_TABLE = "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"
# The rows whose MFU the presets' best_mfu quotes (the plausibility bound).
BEST_MFU_ROWS = {(H100_TABLE, "7b", 2048, 8), (A100_TABLE, "7b", 2048, 8)}
# MPT sizes (d_model, n_layers, n_heads) from llm-foundry scripts/train/yamls/pretrain/mpt-<size>.yaml,
# vocabulary 50368, flash attention, expansion ratio 4.
MPT = {
    "125m": (768, 12, 12),
    "350m": (1024, 24, 16),
    "760m": (1536, 24, 12),
    "1b": (2048, 24, 16),
    "3b": (2560, 32, 20),
    "7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
    "30b": (7168, 48, 56),
    "70b": (8192, 80, 64),
}
MPT_MISMATCHES = (
    "MPT modelled as a GPT-2 of its width/depth/heads (learned positions and biases instead of ALiBi and no bias: "
    "<0.1% of parameters)",
    "FSDP's per-block units modelled by chunks the search sizes (chunk size, cache blocks and prefetch free)",
)


@dataclass(frozen=True)
class Setup:
    """One published measurement and the configuration it ran.

    Attributes:
        name: short label.
        source: where the figure is (repository, path, commit, table).
        row: the published row as quoted (the columns that matter).
        model: MPT size key, or a model YAML under configs/models.
        hardware: the preset the setup is compared on.
        gpus_per_node: GPUs per node.
        nodes: nodes.
        seq_len: tokens per sample.
        micro_batch_size: samples per micro-batch per GPU.
        grad_accum_steps: micro-batches per step.
        checkpointing: "all" or "none".
        tokens_per_s_per_gpu: the published figure (tokens per second per GPU).
        mismatches: what the pinned plan cannot express.
        defines_bound: the row is the best MFU published for its hardware, which the preset's
            ``best_mfu`` (the plausibility bound) quotes: its prediction is not independent.
    """

    name: str
    source: str
    row: str
    model: str
    hardware: str
    gpus_per_node: int
    nodes: int
    seq_len: int
    micro_batch_size: int
    grad_accum_steps: int
    checkpointing: str
    tokens_per_s_per_gpu: float
    mismatches: tuple[str, ...] = ()
    defines_bound: bool = False


def _foundry(table: str, size: str, seq: int, gpus: int, mfu: str, micro: int, accum: int, tps: int, ckpt: bool):
    hardware = "h100-80gb-sxm" if table == H100_TABLE else "a100-80gb-sxm"
    row = (
        f"| {size} | {seq} | {gpus} | {'h100_80gb' if hardware.startswith('h100') else 'a100_80gb'} | MFU {mfu} | "
        f"micro {micro} | accum {accum} | {tps} T/s/GPU | FULL_SHARD | checkpointing {ckpt} |"
    )
    extra = ("llm-foundry's amp_bf16 keeps fp32 master weights like the engine",)
    return Setup(
        name=f"MPT-{size} s{seq} {gpus}x{hardware.split('-')[0].upper()}",
        source=LLM_FOUNDRY.format(table=table),
        row=row,
        model=size,
        hardware=hardware,
        gpus_per_node=min(gpus, 8),
        nodes=max(1, gpus // 8),
        seq_len=seq,
        micro_batch_size=micro,
        grad_accum_steps=accum,
        checkpointing="all" if ckpt else "none",
        tokens_per_s_per_gpu=float(tps),
        mismatches=MPT_MISMATCHES + extra,
        defines_bound=(table, size, seq, gpus) in BEST_MFU_ROWS,
    )


TITAN_MISMATCHES = (
    "torchtitan's H100s are 96 GB HBM2e SXM at 500 W (2.4 TB/s), compared on the h100-80gb-sxm preset (80 GB, 700 W)",
    "selective (per-op) activation checkpointing modelled as checkpointing every 2nd block",
    "FSDP2's per-block units modelled by chunks the search sizes",
)

PUBLISHED: tuple[Setup, ...] = (
    _foundry(H100_TABLE, "760m", 2048, 8, "34.9", 24, 2, 63147, False),
    _foundry(H100_TABLE, "1b", 2048, 8, "41.82", 14, 1, 45455, False),
    _foundry(H100_TABLE, "1b", 32768, 8, "33.54", 1, 4, 12025, False),
    _foundry(H100_TABLE, "3b", 2048, 16, "43.73", 10, 3, 24142, False),
    _foundry(H100_TABLE, "3b", 8192, 8, "40.31", 3, 6, 16578, False),
    _foundry(H100_TABLE, "7b", 2048, 8, "46.44", 6, 1, 10643, False),
    _foundry(H100_TABLE, "7b", 4096, 8, "40.42", 16, 2, 8611, True),
    _foundry(H100_TABLE, "13b", 2048, 8, "39.79", 2, 1, 4792, False),
    _foundry(H100_TABLE, "13b", 4096, 8, "41.6", 10, 3, 4717, True),
    _foundry(H100_TABLE, "30b", 2048, 8, "38.11", 3, 21, 2002, True),
    _foundry(H100_TABLE, "70b", 2048, 64, "42.57", 8, 4, 1039, True),
    _foundry(A100_TABLE, "125m", 2048, 8, "44.79", 40, 2, 142830, False),
    _foundry(A100_TABLE, "350m", 2048, 8, "51.62", 32, 2, 58782, False),
    _foundry(A100_TABLE, "1b", 2048, 8, "59.86", 14, 4, 20513, False),
    _foundry(A100_TABLE, "3b", 2048, 8, "62.11", 10, 2, 10811, False),
    _foundry(A100_TABLE, "7b", 2048, 8, "64.23", 6, 2, 4641, False),
    _foundry(A100_TABLE, "7b", 16384, 8, "51.96", 4, 2, 2453, True),
    _foundry(A100_TABLE, "13b", 4096, 8, "57.62", 10, 3, 2060, True),
    Setup(
        name="Llama-3.1-8B s8192 8xH100 (torchtitan FSDP)",
        source=TORCHTITAN.format(table="Table 1, row 'FSDP'"),
        row="| FSDP | 5,762 | 82.4 | (TPS/GPU, Memory GiB); 8 GPUs, local batch 2, global 16, selective AC",
        model="llama3-8b",
        hardware="h100-80gb-sxm",
        gpus_per_node=8,
        nodes=1,
        seq_len=8192,
        micro_batch_size=2,
        grad_accum_steps=1,
        checkpointing="every:2",
        tokens_per_s_per_gpu=5762.0,
        mismatches=TITAN_MISMATCHES,
    ),
    Setup(
        name="Llama-3.1-8B s8192 128xH100 (torchtitan FSDP)",
        source=TORCHTITAN.format(table="Table 3, row 'FSDP'"),
        row="| FSDP | 5,605 | 67.0 | (TPS/GPU, Memory GiB); 128 GPUs, local batch 2, global 256, selective AC",
        model="llama3-8b",
        hardware="h100-80gb-sxm",
        gpus_per_node=8,
        nodes=16,
        seq_len=8192,
        micro_batch_size=2,
        grad_accum_steps=1,
        checkpointing="every:2",
        tokens_per_s_per_gpu=5605.0,
        mismatches=TITAN_MISMATCHES,
    ),
)


def profile_of(setup: Setup) -> ModelProfile:
    """The profile of a setup's model: analytic for MPT sizes, traced on the meta device otherwise."""
    if setup.model in MPT:
        hidden, layers, heads = MPT[setup.model]
        return gpt2_profile(
            f"mpt-{setup.model}",
            hidden=hidden,
            layers=layers,
            heads=heads,
            vocab=50368,
            positions=setup.seq_len,
            seq_len=setup.seq_len,
            dtype="bf16",
            flash_attention=True,
        )
    from elixir_tune.profiler import profile_model

    return profile_model(
        str(paths.MODEL_CONFIGS_DIR / f"{setup.model}.yaml"), batch_size=1, seq_len=setup.seq_len, dtype="bf16"
    )


def _run(profile: ModelProfile, setup: Setup, fixed: dict, lift_memory: bool = False) -> dict:
    """The best plan of one setup under ``fixed``. ``lift_memory``: when nothing fits, search again
    with the device memory limit lifted (the peer ran the configuration, so the memory model is
    what over-predicts), and say by how much the plan is over the preset's usable memory."""
    world = setup.gpus_per_node * setup.nodes
    batch = setup.micro_batch_size * setup.grad_accum_steps * world
    hardware = load_hardware(setup.hardware)
    over_memory = False
    try:
        result = search(
            profile,
            hardware,
            gpus_per_node=setup.gpus_per_node,
            nodes=setup.nodes,
            global_batch_size=batch,
            fixed=fixed,
            loop="forward_backward",
        )
    except InfeasibleError as error:
        if not lift_memory:
            return {"error": str(error).split("; try:")[0]}
        lifted = dataclasses.replace(hardware, usable_memory_bytes=hardware.usable_memory_bytes * 4)
        lifted.gpu_memory_bytes = max(lifted.gpu_memory_bytes, lifted.usable_memory_bytes)
        try:
            result = search(
                profile,
                lifted,
                gpus_per_node=setup.gpus_per_node,
                nodes=setup.nodes,
                global_batch_size=batch,
                fixed=fixed,
                loop="forward_backward",
            )
        except (InfeasibleError, ValueError) as again:
            return {"error": str(again).split("; try:")[0]}
        over_memory = True
    except ValueError as error:
        return {"error": str(error).split("; try:")[0]}
    best = result.candidates[0]
    row = best.row()
    breakdown = best.estimate.breakdown
    clamp_s = breakdown.get("bound_clamp_s", 0.0)
    return {
        "tokens_per_s_per_gpu": best.tokens_per_s / world,
        "unbounded_tokens_per_s_per_gpu": best.tokens_per_s / world * best.step_time_s / (best.step_time_s - clamp_s),
        "mfu": best.mfu,
        "step_time_s": best.step_time_s,
        "shape": row,
        "layout": best.layout.describe(),
        "breakdown": {key: round(value, 6) for key, value in breakdown.items()},
        "peak_gpu_gib": round(best.memory.peak_gpu_bytes / 2**30, 2),
        "over_usable_memory": over_memory,
        "usable_gib": round(hardware.usable_memory_bytes / 2**30, 2),
    }


def run_setup(setup: Setup) -> dict:
    """Pinned and free predictions of one setup."""
    profile = profile_of(setup)
    pinned = {
        "dtype": "bf16",
        "offload": 0.0,
        "micro_batch_size": setup.micro_batch_size,
        "checkpointing": setup.checkpointing,
        "pipeline": 1,
        "tensor": 1,
        "accumulation": "standard",
    }
    started = time.perf_counter()
    pinned_result = _run(profile, setup, pinned, lift_memory=True)
    free_result = _run(profile, setup, {"dtype": "bf16"})
    out = {
        "name": setup.name,
        "source": setup.source,
        "row": setup.row,
        "model": setup.model,
        "params": profile.num_params,
        "hardware": setup.hardware,
        "gpus": setup.gpus_per_node * setup.nodes,
        "seq_len": setup.seq_len,
        "micro_batch_size": setup.micro_batch_size,
        "grad_accum_steps": setup.grad_accum_steps,
        "checkpointing": setup.checkpointing,
        "published_tokens_per_s_per_gpu": setup.tokens_per_s_per_gpu,
        "mismatches": list(setup.mismatches),
        "defines_bound": setup.defines_bound,
        "pinned": pinned_result,
        "free": free_result,
        "search_s": round(time.perf_counter() - started, 1),
    }
    if "tokens_per_s_per_gpu" in pinned_result:
        out["ratio"] = pinned_result["tokens_per_s_per_gpu"] / setup.tokens_per_s_per_gpu
        if "tokens_per_s_per_gpu" in free_result:
            out["free_speedup"] = free_result["tokens_per_s_per_gpu"] / pinned_result["tokens_per_s_per_gpu"]
    return out


def _plan_text(result: dict) -> str:
    if "error" in result:
        return "no plan: " + result["error"].replace("|", "/")[:120]
    s = result["shape"]
    every = s["checkpointing"]
    ckpt = "none" if every == 0 else "all" if every == 1 else f"1/{every}"
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
        clamped = "clamped to" if breakdown.get("bound_clamp_s", 0) > 0 else "below"
        text += f"; {clamped} bound: {BOUND_LABELS[binding]} ({breakdown[binding]:.3g} s)"
    return text


def summary(rows: list[dict]) -> dict:
    """Median and worst |ratio - 1| over the setups with a pinned prediction, and over those
    whose figure the presets do not quote (``independent_*``)."""
    errors = [abs(row["ratio"] - 1) for row in rows if "ratio" in row]
    if not errors:
        return {"setups": len(rows), "compared": 0}
    independent = [abs(row["ratio"] - 1) for row in rows if "ratio" in row and not row["defines_bound"]]
    free_bounded = sum(
        1
        for row in rows
        if "tokens_per_s_per_gpu" in row["free"] and row["free"]["breakdown"].get("bound_clamp_s", 0) > 0
    )
    return {
        "independent_median_abs_error": round(statistics.median(independent), 4) if independent else None,
        "independent_max_abs_error": round(max(independent), 4) if independent else None,
        "free_plans_clamped_to_bound": free_bounded,
        "setups": len(rows),
        "compared": len(errors),
        "median_abs_error": round(statistics.median(errors), 4),
        "max_abs_error": round(max(errors), 4),
        "within_10pct": sum(e <= 0.10 for e in errors),
        "beyond_25pct": sum(e > 0.25 for e in errors),
    }


def markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        "# The cost model against published training throughput",
        "",
        f"Command: `{report['command']}` ({report['elapsed_s']} s). Predictions of the cost model only (nothing ran "
        "on a GPU), against figures quoted from their sources (below each table row's source and the quoted row).",
        "",
        "**pinned**: the peer's configuration (data parallelism over all GPUs, its micro-batch, accumulation, "
        "checkpointing, bf16, no offload; mismatches listed per setup). **free**: the same model, cluster and global "
        "batch, everything else searched (pipeline, tensor and layered plans included). ratio = predicted / "
        "published tokens/s per GPU; speed-up = free / pinned predicted tokens/s.",
        "",
        f"Setups: {s['setups']}, compared: {s.get('compared', 0)}; median |ratio - 1| = "
        f"{s.get('median_abs_error', float('nan')):.1%}, max {s.get('max_abs_error', float('nan')):.1%}, "
        f"{s.get('within_10pct', 0)} within 10%, {s.get('beyond_25pct', 0)} beyond 25%. Without the setups marked "
        f"`*` (the best published MFU of their hardware, which the preset's bound quotes): median "
        f"{s.get('independent_median_abs_error') or float('nan'):.1%}, max {s.get('independent_max_abs_error') or float('nan'):.1%}. "
        f"Free plans raised to the plausibility bound: {s.get('free_plans_clamped_to_bound', 0)}.",
        "",
        "`unbounded ratio`: the pinned prediction before the plausibility bound raised it (equal to ratio when the "
        "bound does not bind).",
        "",
        "| setup | published tok/s/GPU | pinned tok/s/GPU | ratio | unbounded ratio | pinned MFU | free tok/s/GPU "
        "| speed-up | free MFU | free plan |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in report["rows"]:
        pinned, free = row["pinned"], row["free"]
        p_tps = f"{pinned['tokens_per_s_per_gpu']:.0f}" if "tokens_per_s_per_gpu" in pinned else "-"
        f_tps = f"{free['tokens_per_s_per_gpu']:.0f}" if "tokens_per_s_per_gpu" in free else "-"
        ratio = f"{row['ratio']:.2f}" if "ratio" in row else "-"
        speedup = f"{row['free_speedup']:.2f}x" if "free_speedup" in row else "-"
        p_mfu = f"{pinned['mfu']:.3f}" if "mfu" in pinned else "-"
        f_mfu = f"{free['mfu']:.3f}" if "mfu" in free else "-"
        unbounded = pinned.get("unbounded_tokens_per_s_per_gpu")
        raw = f"{unbounded / row['published_tokens_per_s_per_gpu']:.2f}" if unbounded else "-"
        name = row["name"] + (" `*`" if row.get("defines_bound") else "")
        lines.append(
            f"| {name} | {row['published_tokens_per_s_per_gpu']:.0f} | {p_tps} | {ratio} | {raw} | {p_mfu} | {f_tps} "
            f"| {speedup} | {f_mfu} | {_plan_text(free)} |"
        )
    lines += ["", "## Sources, quoted rows, pinned plans and mismatches", ""]
    for row in report["rows"]:
        lines += [
            f"### {row['name']}",
            "",
            f"- source: {row['source']}",
            f"- quoted: `{row['row']}`",
            f"- pinned plan: {_plan_text(row['pinned'])}",
            f"- free plan: {_plan_text(row['free'])}",
            "- mismatches: " + "; ".join(row["mismatches"]),
            "",
        ]
    if report.get("note"):
        lines += ["## Note", "", report["note"], ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out-prefix",
        default=str(paths.REPO_DIR / "benchmarks" / "results" / "published"),
        help="writes PREFIX.json and PREFIX.md",
    )
    parser.add_argument("--only", default="", help="run only setups whose name contains this text")
    parser.add_argument("--note", default="", help="a closing note for the markdown (e.g. before/after figures)")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    for setup in PUBLISHED:
        if args.only and args.only not in setup.name:
            continue
        row = run_setup(setup)
        rows.append(row)
        print(
            f"{row['name']}: ratio {row.get('ratio', float('nan')):.3f}, "
            f"free speed-up {row.get('free_speedup', float('nan')):.2f} ({row['search_s']} s)",
            flush=True,
        )
    report = {
        "command": COMMAND,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "summary": summary(rows),
        "rows": rows,
        "note": args.note,
    }
    prefix = Path(args.out_prefix)
    prefix.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    prefix.with_suffix(".md").write_text(markdown(report))
    print(json.dumps(report["summary"]))
    print(f"wrote {prefix}.json and {prefix}.md")


if __name__ == "__main__":
    main()
