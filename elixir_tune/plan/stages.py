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
