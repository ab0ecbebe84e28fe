"""The cost model against published training throughput: predicted vs published tokens/s per GPU.

Each setup is a published measurement (scripts/published_setups.py: its source, the exact figure
and the configuration it ran). For each, the joint search runs twice on the matching hardware preset:

* pinned: the peer's configuration as closely as a plan can express it (its tensor and pipeline
  degrees with data parallelism over the rest, the peer's micro-batch, accumulation, checkpointing,
  dtype and offload); what a plan cannot express is listed as the setup's mismatches;
* free: the same model, cluster and global batch, everything else left to the search.

The report gives the pinned prediction over the published figure, and the free plan's predicted
speed-up over the pinned one (above 1.2x, the parts of the step that shrink, as the reason). Nothing
runs on a GPU: these are predictions of the cost model (docs/costmodel-and-search.md) set against figures
quoted from their sources.

    python scripts/bench_published.py                       # all setups: benchmarks/results/published.{json,md}
    python scripts/bench_published.py --sources megatron,zero-offload --out-prefix /tmp/new
    python scripts/bench_published.py --rows "MPT-7b,Llama" --out-prefix /tmp/some
    python scripts/bench_published.py --sources colossalai-pl --hardware a100-40gb-pcie --out-prefix /tmp/pcie
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from published_peer_models import card_memory
from published_report import _plan_text, markdown, memory_lines, micro_batch_section, shared_mismatches, table_row
from published_setups import FAILED, PUBLISHED, SOURCE_KEYS, Setup
from published_summary import EXPLAIN_SPEEDUP, summary

from elixir_tune import paths
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.hardware.spec import HardwareSpec
from elixir_tune.profiler.schema import ModelProfile
from elixir_tune.search import InfeasibleError, search

COMMAND = "python scripts/bench_published.py"
# Written by published_report.py, imported here for the tests and callers that read them from this module.
__all__ = ["markdown", "memory_lines", "micro_batch_section", "shared_mismatches", "table_row"]
# Breakdown entries that are parts of a step's time (the rest are bounds, counts and memory).
TIME_PARTS = (
    "compute_s",
    "recompute_s",
    "exposed_fetch_s",
    "grad_drain_s",
    "optimizer_exposed_s",
    "collective_compute_loss_s",
    "tensor_comm_s",
    "pipeline_bubble_s",
)


def profile_of(setup: Setup) -> ModelProfile:
    """The profile of a setup's model: traced on the meta device when the peer ran a transformers model
    (``transformers_gpt2_profile``) or a model YAML names it, analytic for other GPT-shaped ones."""
    if setup.transformers and setup.gpt is not None:
        hidden, layers, heads, vocab, _flash = setup.gpt
        return transformers_gpt2_profile(
            hidden, layers, heads, vocab, setup.seq_len, setup.dtype, setup.checkpointing != "none"
        )
    if setup.gpt is not None:
        hidden, layers, heads, vocab, flash = setup.gpt
        return gpt2_profile(
            setup.model,
            hidden=hidden,
            layers=layers,
            heads=heads,
            vocab=vocab,
            positions=setup.seq_len,
            seq_len=setup.seq_len,
            dtype=setup.dtype,
            flash_attention=flash,
            dropout=not setup.mpt,
            fused_loss=setup.mpt,
        )
    from elixir_tune.profiler import profile_model

    return profile_model(
        str(paths.MODEL_CONFIGS_DIR / f"{setup.model}.yaml"), batch_size=1, seq_len=setup.seq_len, dtype=setup.dtype
    )


# The peers' model file (a Python builder, profiled like a user's): transformers' GPT2LMHeadModel returning
# its logits, the loss taken outside on them as both Colossal-AI sources do (GPTLMLoss in
# ColossalAI-Pytorch-lightning benchmark/gpt/model.py and ColossalAI examples/language/gpt/train_gpt_demo.py:
# the shifted logits copied contiguous, nn.CrossEntropyLoss in the compute dtype). transformers' own loss
# (given labels) upcasts the logits to fp32 first, 10 bytes per logit in fp16 where the peers held 6.
PEER_GPT2 = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel


class PeerGPT2(GPT2LMHeadModel):
    def forward(self, input_ids, **kwargs):
        logits = super().forward(input_ids=input_ids).logits
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = input_ids[..., 1:].contiguous()
        return torch.nn.functional.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def build_model():
    config = GPT2Config(n_embd={hidden}, n_layer={layers}, n_head={heads}, vocab_size={vocab}, n_positions={seq_len},
                        use_cache=False)
    return PeerGPT2._from_config(config, attn_implementation="eager")


def example_batch(batch_size, seq_len):
    return {{"input_ids": torch.randint(0, {vocab}, (batch_size, seq_len))}}
"""


@functools.cache
def transformers_gpt2_profile(
    hidden: int, layers: int, heads: int, vocab: int, seq_len: int, dtype: str, checkpointed: bool
) -> ModelProfile:
    """transformers' GPT-2 of one shape as the peer built it (``GPT2Config`` defaults otherwise, eager
    attention as in 2022, the loss on its logits as the peer took it: ``PEER_GPT2``), profiled on the
    meta device like a user's model file: its pointwise ops are counted (``elixir_tune.pointwise``),
    where ``gpt2_profile`` has none. Cached per shape."""
    from elixir_tune.profiler import profile_model

    text = PEER_GPT2.format(hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq_len=seq_len)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"peer_gpt2_h{hidden}_l{layers}.py"
        path.write_text(text)
        checkpointing = "all" if checkpointed else "none"
        return profile_model(str(path), batch_size=1, seq_len=seq_len, dtype=dtype, checkpointing=checkpointing)


def _lifted(hardware: HardwareSpec) -> HardwareSpec:
    """The same node with 4x the usable device memory (the memory model is what over-predicts)."""
    lifted = dataclasses.replace(hardware, usable_memory_bytes=hardware.usable_memory_bytes * 4)
    lifted.gpu_memory_bytes = max(lifted.gpu_memory_bytes, lifted.usable_memory_bytes)
    return lifted


def peer_links(hardware: HardwareSpec, setup: Setup) -> HardwareSpec:
    """``hardware`` with its all-gathers slowed by the peer's ``gather_width``: the pinned plan then moves
    the peer's bytes. Across nodes one rate carries both collectives: a micro-batch's two gathers and one
    reduce-scatter move 2 x width + 1 units where the plan moves 3."""
    width = setup.gather_width
    if width == 1.0:
        return hardware
    if setup.nodes > 1:
        return dataclasses.replace(hardware, inter_node_gbps=hardware.inter_node_gbps * 3 / (2 * width + 1))
    return dataclasses.replace(hardware, allgather_gbps=hardware.allgather_gbps / width)


def best_plan(
    profile: ModelProfile,
    setup: Setup,
    fixed: dict,
    lift_memory: bool = False,
    hardware: HardwareSpec | None = None,
    waves: bool = True,
    peer: bool = False,
) -> dict:
    """The best plan of one setup under ``fixed``, as a report entry.

    Args:
        profile: the setup's model profile.
        setup: the published setup (cluster and global batch).
        fixed: pinned choices (``search.space.FIX_KEYS``).
        lift_memory: when nothing fits, search again with the device memory limit lifted (the peer
            ran the configuration, so the memory model is what over-predicts) and say so.
        hardware: a spec to compare on instead of the setup's preset (a sensitivity check).
        waves: keep the preset's GEMM wave model (False: ``sm_count`` 0, the block rate whatever the
            micro-batch, to show what the mechanism moves).
        peer: the plan pins the peer's configuration: its collectives move the peer's bytes (``peer_links``).

    Returns:
        ``{"error": ...}`` when no plan is found, else its tokens/s per GPU, MFU, step time,
        shape, layout, breakdown and peak memory.
    """
    if hardware is None and setup.card_memory_bytes:
        hardware = card_memory(setup.hardware, setup.card_memory_bytes)
    hardware = hardware or load_hardware(setup.hardware)
    if not waves:
        hardware = dataclasses.replace(hardware, sm_count=0)
    if peer:
        hardware = peer_links(hardware, setup)
    over_memory = False
    attempts = [hardware, _lifted(hardware)] if lift_memory else [hardware]
    result = None
    for attempt, spec in enumerate(attempts):
        try:
            result = search(
                profile,
                spec,
                gpus_per_node=setup.gpus_per_node,
                nodes=setup.nodes,
                global_batch_size=setup.global_batch_size,
                fixed=fixed,
                loop="forward_backward",
            )
            over_memory = attempt > 0
            break
        except (InfeasibleError, ValueError) as error:
            if attempt == len(attempts) - 1 or not isinstance(error, InfeasibleError):
                return {"error": str(error).split("; try:")[0]}
    assert result is not None
    best = result.candidates[0]
    breakdown = best.estimate.breakdown
    per_gpu = best.tokens_per_s / setup.gpus
    return {
        "tokens_per_s_per_gpu": per_gpu,
        "mfu": best.mfu,
        "step_time_s": best.step_time_s,
        "shape": best.row(),
        "layout": best.layout.describe(),
        "breakdown": {key: round(value, 6) for key, value in breakdown.items()},
        "peak_gpu_gib": round(best.memory.peak_gpu_bytes / 2**30, 2),
        "over_usable_memory": over_memory,
        "usable_gib": round(hardware.usable_memory_bytes / 2**30, 2),
    }


def pinned_choices(setup: Setup) -> dict:
    """The peer's configuration as search pins."""
    pinned = {
        "dtype": setup.dtype,
        "micro_batch_size": setup.micro_batch_size,
        "checkpointing": setup.checkpointing,
        "pipeline": setup.pipeline,
        "tensor": setup.tensor,
        "context": 1,  # none of the published runs split its sequences
        # A pipeline plan's accumulation is layered (its schedule, not the accumulation, orders the micro-batches).
        "accumulation": "standard" if setup.pipeline == 1 else "layered",
    }
    if setup.pipeline > 1:
        pinned["assignment"] = setup.assignment
        pinned["schedule"] = setup.schedule
    if setup.offload is not None:
        pinned["offload"] = setup.offload
    if setup.prefetch is not None:
        pinned["prefetch"] = setup.prefetch
    if setup.cache_blocks is not None:
        pinned["cache_blocks"] = setup.cache_blocks
    return pinned


def failed_check(setup: Setup) -> dict:
    """A published configuration that ran out of memory, pinned: refused (as it must be) or the plan that
    fits it (a defect of the memory model), with the peak predicted when the limit is lifted."""
    profile = profile_of(setup)
    result = best_plan(profile, setup, pinned_choices(setup), lift_memory=True, peer=True)
    return {
        "name": setup.name,
        "source": setup.source,
        "row": setup.row,
        "refused": bool(result.get("over_usable_memory")) or "error" in result,
        "peak_gpu_gib": result.get("peak_gpu_gib"),
        "usable_gib": result.get("usable_gib"),
        "plan": _plan_text(result),
    }


def speedup_reason(pinned: dict, free: dict) -> str:
    """Why the free plan is faster, in one line: the plan choices that differ and the step parts that shrink."""
    choices = []
    for key in ("micro_batch_size", "checkpointing", "offload", "accumulation"):
        if pinned["shape"].get(key) != free["shape"].get(key):
            choices.append(f"{key} {pinned['shape'].get(key)} -> {free['shape'].get(key)}")
    if pinned["layout"] != free["layout"]:
        choices.append(f"layout {pinned['layout']} -> {free['layout']}")
    parts = []
    for key in TIME_PARTS:
        before, after = pinned["breakdown"].get(key, 0.0), free["breakdown"].get(key, 0.0)
        if before - after > 0.02 * pinned["step_time_s"]:
            parts.append((before - after, f"{key} {before:.3g} -> {after:.3g} s"))
    parts.sort(reverse=True)
    return "; ".join(choices) + (": " + ", ".join(text for _, text in parts) if parts else "")


def run_setup(setup: Setup, waves: bool = True) -> dict:
    """Pinned and free predictions of one setup (``waves``: ``best_plan``'s)."""
    profile = profile_of(setup)
    started = time.perf_counter()
    pinned_result = best_plan(profile, setup, pinned_choices(setup), lift_memory=True, waves=waves, peer=True)
    free_result = best_plan(profile, setup, {"dtype": setup.dtype}, waves=waves)
    out = {
        "name": setup.name,
        "source": setup.source,
        "source_key": setup.source_key,
        "row": setup.row,
        "model": setup.model,
        "params": profile.num_params,
        "hardware": setup.hardware,
        "gpus": setup.gpus,
        "seq_len": setup.seq_len,
        "micro_batch_size": setup.micro_batch_size,
        "grad_accum_steps": setup.grad_accum_steps,
        "checkpointing": setup.checkpointing,
        "published_tokens_per_s_per_gpu": setup.tokens_per_s_per_gpu,
        "mismatches": list(setup.mismatches),
        "defines_bound": setup.defines_bound,
        "fitted_source": setup.fitted_source,
        "first_step_in_window": setup.first_step_in_window,
        "printed_twice": setup.printed_twice,
        "pinned": pinned_result,
        "free": free_result,
        "search_s": round(time.perf_counter() - started, 1),
    }
    if "tokens_per_s_per_gpu" in pinned_result:
        out["ratio"] = pinned_result["tokens_per_s_per_gpu"] / setup.tokens_per_s_per_gpu
        if "tokens_per_s_per_gpu" in free_result:
            out["free_speedup"] = free_result["tokens_per_s_per_gpu"] / pinned_result["tokens_per_s_per_gpu"]
            if out["free_speedup"] > EXPLAIN_SPEEDUP:
                out["speedup_reason"] = speedup_reason(pinned_result, free_result)
    return out


def selected(sources: str, rows: str) -> list[Setup]:
    """The setups of the named source families (comma-separated ``source_key``s) whose name holds one
    of the comma-separated ``rows`` texts; empty filters select everything."""
    keys = [key.strip() for key in sources.split(",") if key.strip()]
    unknown = [key for key in keys if key not in SOURCE_KEYS]
    if unknown:
        raise SystemExit(f"--sources {','.join(unknown)}: unknown (known: {', '.join(SOURCE_KEYS)})")
    texts = [text.strip() for text in rows.split(",") if text.strip()]
    chosen = [
        setup
        for setup in PUBLISHED
        if (not keys or setup.source_key in keys) and (not texts or any(text in setup.name for text in texts))
    ]
    if not chosen:
        raise SystemExit("no setup matches --sources/--rows; names are listed in scripts/published_setups.py")
    return chosen


def merged(parts: list[dict], note: str) -> dict:
    """One report from parts run separately: their rows in table order, summarised again.

    A setup in more than one part keeps the row of the last part that has it, so a table can be merged
    with a rerun of some of its rows (``--merge published.json rerun.json``); ``replaced`` names those
    setups. A part that is itself a merge contributes the commands of its own parts (each command once),
    so the report names every command that produced a row.
    """
    order = {setup.name: index for index, setup in enumerate(PUBLISHED)}
    latest: dict[str, dict] = {}
    replaced = []
    for part in parts:
        for row in part["rows"]:
            if row["name"] in latest:
                replaced.append(row["name"])
            latest[row["name"]] = row
    rows = sorted(latest.values(), key=lambda row: order.get(row["name"], len(order)))
    commands = [command for part in parts for command in part.get("parts") or [part["command"]]]
    return {
        "command": COMMAND,
        "parts": list(dict.fromkeys(commands)),
        "elapsed_s": max(part["elapsed_s"] for part in parts),
        "summary": summary(rows),
        "rows": rows,
        "failed": next((part["failed"] for part in reversed(parts) if part.get("failed")), []),
        "note": note,
        "replaced": replaced,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out-prefix",
        default=str(paths.REPO_DIR / "benchmarks" / "results" / "published"),
        help="writes PREFIX.json and PREFIX.md",
    )
    parser.add_argument(
        "--sources", default="", help=f"only these source families, comma-separated: {', '.join(SOURCE_KEYS)}"
    )
    parser.add_argument("--rows", default="", help="only setups whose name contains one of these comma-separated texts")
    parser.add_argument(
        "--hardware",
        default="",
        help="a sensitivity check: compare on this preset (or hardware file) instead of each setup's own",
    )
    parser.add_argument(
        "--no-waves",
        action="store_true",
        help="a sensitivity check: every preset without its GEMM wave model (sm_count 0)",
    )
    parser.add_argument("--note", default="", help="a closing note for the markdown (e.g. before/after figures)")
    parser.add_argument(
        "--render", action="store_true", help="no search: write PREFIX.md again from PREFIX.json and --note"
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        default=[],
        metavar="PART.json",
        help="no search: one report from parts run separately (each with --sources/--rows), rows in table order; "
        "a setup in several parts keeps the last part's row",
    )
    args = parser.parse_args()
    prefix = Path(args.out_prefix)
    if args.merge:
        parts = [json.loads(Path(path).read_text()) for path in args.merge]
        report = merged(parts, args.note)
        if report["replaced"]:
            print(f"rows of later parts replace earlier ones: {', '.join(report['replaced'])}")
        write_report(prefix, report, f" from {len(parts)} parts")
        return
    if args.render:
        report = json.loads(prefix.with_suffix(".json").read_text())
        report["note"] = args.note
        prefix.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        prefix.with_suffix(".md").write_text(markdown(report))
        print(f"wrote {prefix}.md from {prefix}.json")
        return
    started = time.perf_counter()
    rows = []
    for setup in selected(args.sources, args.rows):
        row = run_setup(
            dataclasses.replace(setup, hardware=args.hardware) if args.hardware else setup, waves=not args.no_waves
        )
        rows.append(row)
        print(
            f"{row['name']}: ratio {row.get('ratio', float('nan')):.3f}, "
            f"free speed-up {row.get('free_speedup', float('nan')):.2f} ({row['search_s']} s)",
            flush=True,
        )
    chosen = {setup.source_key for setup in selected(args.sources, args.rows)}
    failed = [failed_check(setup) for setup in FAILED if setup.source_key in chosen and not args.rows]
    command = (
        COMMAND
        + "".join(
            f" --{key} {value!r}"
            for key, value in (("sources", args.sources), ("rows", args.rows), ("hardware", args.hardware))
            if value
        )
        + (" --no-waves" if args.no_waves else "")
    )
    report = {
        "command": command,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "summary": summary(rows),
        "rows": rows,
        "failed": failed,
        "note": args.note,
    }
    write_report(prefix, report)


def generated() -> dict:
    """When, where and from which commit the report is written (a ``+`` marks uncommitted changes)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=paths.REPO_DIR)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "elixir_tune", "scripts", "configs"],
        capture_output=True,
        text=True,
        cwd=paths.REPO_DIR,
    )
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()})",
        "commit": head.stdout.strip() + ("+" if dirty.stdout.strip() else ""),
        # Other sessions share this machine: the load says how busy it was (the table's seconds only).
        "load_average": " ".join(f"{value:.2f}" for value in os.getloadavg()),
    }


def write_report(prefix: Path, report: dict, origin: str = "") -> None:
    """Writes ``report`` as PREFIX.json and PREFIX.md and prints its summary."""
    report["generated"] = generated()
    prefix.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    prefix.with_suffix(".md").write_text(markdown(report))
    print(json.dumps(report["summary"]))
    print(f"wrote {prefix}.json and {prefix}.md{origin}")


if __name__ == "__main__":
    main()
