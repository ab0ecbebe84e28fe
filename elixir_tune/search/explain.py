"""The search's why-line: what the winning candidate does and what it beats (``explain_winner``)."""

from __future__ import annotations

from elixir_tune.costmodel.parallel import DATA_ONLY, Layout
from elixir_tune.search.candidate import Candidate

# How the why-line names each pipeline schedule (plan.schema.PipelineSchedule).
# How the why-line names each context mode (plan.schema.ContextMode).
CONTEXT_WORDS = {
    "ulysses": "Ulysses, all-to-all over heads",
    "allgather": "keys and values all-gathered",
    "ring": "ring attention",
}
SCHEDULE_WORDS = {
    "looped_bfs": "looped breadth-first",
    "1f1b": "1F1B",
    "gpipe": "GPipe",
    "interleaved_1f1b": "interleaved 1F1B",
}


def explain_layout(best: Candidate, by_layout: dict[Layout, Candidate] | None = None, layouts_tried: int = 1) -> str:
    """Why the winner's parallel layout: its bubble, tensor and expert traffic, and the best of the others.

    Args:
        best: the winning candidate.
        by_layout: the fastest candidate of each layout the search scored.
        layouts_tried: parallel layouts searched (some may have had no candidate scored: pruned
            by the lower bound, or nothing fit).

    Returns:
        A clause for the why-line ("" when only data parallelism was possible).
    """
    by_layout = by_layout or {}
    layout, b = best.layout, best.estimate.breakdown
    step = best.step_time_s
    parts = []
    if layout.pipeline > 1:
        parts.append(
            f"pipeline {layout.pipeline} stages ({layout.assignment}, {SCHEDULE_WORDS[layout.schedule]}): bubble "
            f"{b.get('pipeline_bubble_s', 0.0) / step:.1%} of the step, point-to-point sends "
            f"{b.get('p2p_s', 0.0) / step:.1%} exposed"
        )
    if layout.tensor > 1:
        parts.append(
            f"tensor {layout.tensor} ({layout.tensor_mode}): its collectives are "
            f"{b.get('tensor_comm_s', 0.0) / step:.1%} of the step"
        )
    if layout.expert > 1:
        parts.append(
            f"expert {layout.expert} (1/{layout.expert} of the experts per rank): its all-to-alls are "
            f"{b.get('expert_comm_s', 0.0) / step:.1%} of the step"
        )
    if layout.context > 1:
        extra = b.get("context_attention_s", 0.0)
        parts.append(
            f"context {layout.context} ({CONTEXT_WORDS[layout.context_mode]}; 1/{layout.context} of every sequence "
            f"per rank, so its activations): its exchange is {b.get('context_comm_s', 0.0) / step:.1%} of the step"
            + (f", the masked half of its attention {extra / step:.1%}" if extra else "")
        )
    others = sorted((c.step_time_s, key.describe()) for key, c in by_layout.items() if key != layout)
    if not parts and layouts_tried <= 1:
        return ""
    line = "; ".join(parts) if parts else "data parallelism only"
    unscored = layouts_tried - 1 - len(others)
    if unscored > 0:
        line += (
            f"; {unscored} other pipeline/tensor/expert/context layout(s) had no candidate: their compute with tensor "
            "collectives, all-to-alls and bubble alone is slower, or they do not fit"
        )
    if others:
        slower = others[0][0] / step - 1
        line += f"; the best other layout ({others[0][1]}) is {slower:.1%} slower"
        if DATA_ONLY != layout and DATA_ONLY in by_layout and others[0][1] != DATA_ONLY.describe():
            line += f", data parallelism only {by_layout[DATA_ONLY].step_time_s / step - 1:.1%} slower"
    return line


def explain_winner(
    candidates: list[Candidate],
    pinned: dict | None = None,
    device: str = "cuda",
    by_layout: dict[Layout, Candidate] | None = None,
    layouts_tried: int = 1,
) -> str:
    """One line on why the best candidate wins.

    Args:
        candidates: the best candidates, fastest first.
        pinned: the pinned choices (``parse_fixed``), which are not the search's doing.
        device: the hardware's device, ``cuda`` or ``cpu`` (named in the line).
        by_layout: the fastest candidate of each parallel layout scored (``Exploration.best_by_layout``).
        layouts_tried: parallel layouts searched.

    Returns:
        The line.
    """
    where = "the GPU" if device == "cuda" else "the device (CPU)"
    pinned = pinned or {}
    best = candidates[0]
    b = best.estimate.breakdown
    s = best.shape
    if s.num_offloaded == 0 and s.cache_blocks >= best.num_cacheable:
        what = f"everything fits on {where} with every chunk cached (ZeRO-2-like), so nothing is offloaded"
    elif s.num_offloaded == 0:
        what = (
            f"every shard stays on {where}, with {s.cache_blocks} of {best.num_cacheable} chunks cached "
            "at once (ZeRO-3-like)"
        )
    elif "offload" in pinned:
        what = f"offloads {best.offload_share:.0%} of the shards as pinned, with {s.cache_blocks} cache blocks"
    else:
        what = (
            f"offloads {best.offload_share:.0%} of the shards, which frees room for {s.cache_blocks} cache "
            f"blocks and micro-batch {s.micro_batch_size}"
        )
    compute_share = b.get("compute_s", 0.0) / best.step_time_s
    line = (
        f"{what}; compute is {compute_share:.0%} of the step, {b.get('exposed_fetch_s', 0.0):.3g} s of fetches exposed"
    )
    if best.layout.pipeline > 1 and best.layout.schedule == "1f1b" and s.grad_accum_steps > 1:
        line += (
            f"; the {s.grad_accum_steps} micro-batches run one forward, one backward (1F1B): stage s holds "
            f"at most {best.layout.pipeline} - s micro-batches' activations, not {s.grad_accum_steps}"
        )
    elif s.layered and best.layout.pipeline > 1:
        line += (
            f"; the {s.grad_accum_steps} micro-batches run layer by layer, breadth-first through each stage's blocks (each chunk "
            "fetched once per pass and reduced once per step, their activations held together)"
        )
    elif s.layered:
        line += (
            f"; the {s.grad_accum_steps} micro-batches run layer by layer (layered accumulation: each chunk fetched "
            f"and reduced once per step instead of {s.grad_accum_steps} times, their activations held together)"
        )
    parallel = explain_layout(best, by_layout, layouts_tried)
    if parallel:
        line += "; " + parallel
    if len(candidates) > 1:
        other = candidates[1]
        diffs = [
            name
            for name, a, c in (
                ("chunk size", s.chunk_size, other.shape.chunk_size),
                ("cache", s.cache_blocks, other.shape.cache_blocks),
                ("offload", s.num_offloaded, other.shape.num_offloaded),
                ("checkpointing", (s.every, s.selective), (other.shape.every, other.shape.selective)),
                ("micro-batch", s.micro_batch_size, other.shape.micro_batch_size),
                ("accumulation", s.accumulation, other.shape.accumulation),
                ("prefetch", s.prefetch, other.shape.prefetch),
                ("parallel layout", best.layout, other.layout),
            )
            if a != c
        ]
        slower = other.step_time_s / best.step_time_s - 1
        differs = ", ".join(diffs) or "nothing visible"
        if slower < 5e-4:
            line += f"; the runner-up (differs in {differs}) is as fast but needs more memory"
        else:
            line += f"; the runner-up (differs in {differs}) is {slower:.1%} slower"
    return line
