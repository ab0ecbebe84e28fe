"""Which pipeline stage holds which block and parameter: one rule for the search and the engine.

The search packs each stage's parameters into that stage's chunks and the engine builds each
stage from the same assignment, so both must agree; this module imports no torch.
"""

from __future__ import annotations


def stage_of_block(block_index: int, num_blocks: int, stages: int, assignment: str) -> int:
    """The pipeline stage of block ``block_index``.

    Args:
        block_index: 0-based position of the block in the model's block list.
        num_blocks: blocks in the list.
        stages: pipeline degree P.
        assignment: ``modular`` (block i on stage i mod P) or ``contiguous`` (runs of about N / P
            consecutive blocks; the first N mod P stages get one more).

    Returns:
        The stage, 0 to P - 1.
    """
    if not 0 <= block_index < num_blocks:
        raise ValueError(f"block {block_index} is outside the model's {num_blocks} blocks")
    if assignment == "modular":
        return block_index % stages
    if assignment == "contiguous":
        base, extra = divmod(num_blocks, stages)
        # The first `extra` stages hold base + 1 blocks each, the rest base.
        boundary = extra * (base + 1)
        if block_index < boundary:
            return block_index // (base + 1)
        return extra + (block_index - boundary) // base
    raise ValueError(f"unknown pipeline assignment {assignment!r} (expected modular or contiguous)")


def last_stage(num_blocks: int, stages: int, assignment: str) -> int:
    """The stage that runs the last block, and so the final norm, the head and the loss (and holds a
    tied embedding's second copy): P - 1 unless a modular split is uneven (3 blocks on 2 stages: 0)."""
    if num_blocks < 1:
        return stages - 1
    return stage_of_block(num_blocks - 1, num_blocks, stages, assignment)


def virtual_stages(num_blocks: int, stages: int, assignment: str) -> list[tuple[int, list[int]]]:
    """The pipeline's virtual stages in order: (stage that runs it, its blocks), each a maximal run of
    consecutive blocks on one stage (modular: every block is one; contiguous: one per stage)."""
    result: list[tuple[int, list[int]]] = []
    for block in range(num_blocks):
        stage = stage_of_block(block, num_blocks, stages, assignment)
        if result and result[-1][0] == stage:
            result[-1][1].append(block)
        else:
            result.append((stage, [block]))
    return result


def schedule_problem(
    num_blocks: int, stages: int, assignment: str, schedule: str, micro_batches: int | None = None
) -> str | None:
    """Why ``schedule`` cannot run this split of the blocks (None: it can), one rule for plan
    validation and the engine.

    A rank runs one virtual stage (``virtual_stages``) after another; rank ``r`` holds virtual stages
    r, r + P, r + 2P, ... (modular: block b on rank b mod P, one virtual stage each; contiguous: one
    per rank). ``looped_bfs`` runs any such split, uneven ones included (modular, 3 blocks on 2
    stages: rank 0 holds blocks 0 and 2, rank 1 block 1). ``gpipe`` and ``1f1b`` run one virtual
    stage per rank; ``interleaved_1f1b`` (torch's) needs the same number on every rank. ``1f1b``
    needs at least P micro-batches per step; ``interleaved_1f1b`` runs rounds of ``max(1, M // P)``
    micro-batches and needs M to be a multiple of the number of rounds.

    Args:
        num_blocks: blocks in the model's block list.
        stages: pipeline degree P.
        assignment: ``modular`` or ``contiguous``.
        schedule: ``looped_bfs``, ``interleaved_1f1b``, ``gpipe`` or ``1f1b``.
        micro_batches: per step (``training.grad_accum_steps``), when known.

    Returns:
        The reason with what to change, or None.
    """
    if stages <= 1 or not 0 < stages <= num_blocks:
        return None  # nothing to split, or a stage without blocks (reported on its own)
    counts = [0] * stages
    for stage, _ in virtual_stages(num_blocks, stages, assignment):
        counts[stage] += 1
    split = f"{assignment} assignment of {num_blocks} blocks to {stages} stages"
    if schedule in ("gpipe", "1f1b") and max(counts) > 1:
        return (
            f"{schedule} runs one virtual stage per rank, but the {split} gives stage {counts.index(max(counts))} "
            f"{max(counts)} non-contiguous runs of blocks; use looped_bfs, or assignment contiguous"
        )
    if schedule == "interleaved_1f1b" and len(set(counts)) > 1:
        return (
            f"interleaved_1f1b needs the same number of virtual stages on every rank, but the {split} gives the "
            f"stages {counts}; use looped_bfs (it runs uneven splits), assignment contiguous, or a block count "
            f"that is a multiple of {stages}"
        )
    if micro_batches is None:
        return None
    if schedule == "1f1b" and micro_batches < stages:
        return (
            f"1f1b needs at least as many micro-batches per step as stages ({stages}), got {micro_batches}; "
            "raise training.grad_accum_steps or use gpipe or looped_bfs"
        )
    rounds = max(1, micro_batches // stages)
    if schedule == "interleaved_1f1b" and micro_batches % rounds:
        return (
            f"interleaved_1f1b runs rounds of micro-batches ({rounds} rounds for {micro_batches} micro-batches on "
            f"{stages} stages), and {micro_batches} is not a multiple of {rounds}; make training.grad_accum_steps a "
            f"multiple of {stages} or less than {2 * stages}, or use looped_bfs"
        )
    return None


def block_index_of(param_name: str, block_list: str) -> int | None:
    """The block a parameter belongs to (``<block_list>.<i>.<...>``), or None outside the blocks."""
    prefix = block_list + "."
    if not block_list or not param_name.startswith(prefix):
        return None
    head = param_name[len(prefix) :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def assign_stages(
    param_names: list[str], block_list: str, num_blocks: int, stages: int, assignment: str
) -> dict[str, int]:
    """The stage of every parameter.

    Parameters of a block go with their block. The others go with the nearest block in first-use
    order: those used before the first block (embeddings) to block 0's stage, those used after
    the last block (final norm, output head) to the last block's stage. A parameter shared by
    several modules appears once, at its first use (the engine gives its other users a copy).

    Args:
        param_names: parameter names in first-use order (the order chunks are packed in).
        block_list: dotted path of the model's block ModuleList.
        num_blocks: blocks in it.
        stages: pipeline degree P.
        assignment: ``modular`` or ``contiguous``.

    Returns:
        Parameter name -> stage.
    """
    if stages == 1:
        return dict.fromkeys(param_names, 0)
    if num_blocks == 0:
        raise ValueError("a pipeline needs the model's repeated blocks (model.block_list); this model has none")
    result: dict[str, int] = {}
    seen_block = False
    for name in param_names:
        index = block_index_of(name, block_list)
        if index is not None:
            seen_block = True
            result[name] = stage_of_block(index, num_blocks, stages, assignment)
        elif not seen_block:
            result[name] = stage_of_block(0, num_blocks, stages, assignment)
        else:
            result[name] = stage_of_block(num_blocks - 1, num_blocks, stages, assignment)
    return result
