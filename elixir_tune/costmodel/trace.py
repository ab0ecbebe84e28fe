"""The access trace at chunk granularity, with checkpointing and per-step compute shares.

The profile's trace lists, per module call (forward then backward), the parameters the module
owns directly; that is where the engine gathers chunks. Here it becomes a list of steps, each the
set of non-resident chunks that must be gathered at once, plus the share of the micro-batch's
FLOPs that runs in the step. Steps whose chunks are a subset of the previous step's cannot miss,
so they are merged into it; that keeps the cache and timeline simulations short.
"""

from __future__ import annotations

from dataclasses import dataclass

from elixir_tune.costmodel.layout import ChunkLayout
from elixir_tune.profiler.schema import ModelProfile

FORWARD, BACKWARD, RECOMPUTE, FORWARD_ONE = 0, 1, 2, 3
# Backward of a matmul costs twice its forward; a recomputed forward costs one forward.
# FORWARD_ONE: one micro-batch's forward of a checkpointed block in a layered step (the block runs
# whole for each micro-batch in turn, see engine/layered.py), where FORWARD steps serve all of them.
_KIND_FLOPS = {FORWARD: 1.0, BACKWARD: 2.0, RECOMPUTE: 1.0, FORWARD_ONE: 1.0}
_ONE_MICRO_BATCH = (RECOMPUTE, FORWARD_ONE)


def forward_length(trace: list[list[int]]) -> int:
    """Number of forward steps in a non-checkpointed trace (the backward mirrors the forward)."""
    steps = [step for step in trace if step]
    half = len(steps) // 2
    if len(steps) % 2 == 0 and steps[:half] == steps[half:][::-1]:
        return half
    for index in range(1, len(steps)):
        if steps[index] == steps[index - 1]:
            return index
    return half


def checkpointed_trace(profile: ModelProfile, every: int, recompute_copies: int = 1) -> list[tuple[list[int], int]]:
    """The module-level trace with blocks 0, every, 2*every, ... checkpointed.

    A checkpointed block runs its forward steps again right before its backward.

    Args:
        profile: the model profile.
        every: 0 for no checkpointing, k for every k-th block.
        recompute_copies: micro-batches of a layered step: a checkpointed block's forward and its
            recomputation run whole for each micro-batch in turn (FORWARD_ONE, RECOMPUTE), while
            the other forward and backward steps serve all micro-batches at once.

    Returns:
        (parameter indices, kind) per step, kind one of FORWARD, BACKWARD, RECOMPUTE, FORWARD_ONE.
    """
    steps = [list(step) for step in profile.trace if step]
    num_forward = forward_length(profile.trace)
    block_of_param = {}
    for block in profile.blocks:
        for index in range(block.first_param, block.first_param + block.num_params):
            block_of_param[index] = block.index

    def block_of(step: list[int]) -> int:
        owners = {block_of_param.get(index, -1) for index in step}
        return owners.pop() if len(owners) == 1 else -1

    if every <= 0 or not profile.blocks:
        return [(step, FORWARD) for step in steps[:num_forward]] + [(step, BACKWARD) for step in steps[num_forward:]]
    out: list[tuple[list[int], int]] = []
    forward = steps[:num_forward]
    start = 0
    while start < len(forward):
        block_index = block_of(forward[start])
        if recompute_copies == 1 or block_index < 0 or block_index % every:
            out.append((forward[start], FORWARD))
            start += 1
            continue
        end = start
        while end < len(forward) and block_of(forward[end]) == block_index:
            end += 1
        for _ in range(recompute_copies):
            out.extend((step, FORWARD_ONE) for step in forward[start:end])
        start = end
    forward_of_block: dict[int, list[list[int]]] = {}
    for step in steps[:num_forward]:
        forward_of_block.setdefault(block_of(step), []).append(step)
    recomputed = set()
    for step in steps[num_forward:]:
        block_index = block_of(step)
        if block_index >= 0 and block_index % every == 0 and block_index not in recomputed:
            recomputed.add(block_index)
            for _ in range(recompute_copies):
                out.extend((fwd, RECOMPUTE) for fwd in forward_of_block.get(block_index, []))
        out.append((step, BACKWARD))
    return out


@dataclass
class ChunkTrace:
    """One micro-batch's access trace over chunks, merged.

    Attributes:
        steps: per step, the non-resident chunk ids it needs gathered together (sorted).
        flops_share: per step, its share of the micro-batch's FLOPs (sums to 1).
        first_use: per chunk id, the step of its first use.
        last_use: per chunk id, the step of its last use (its gradients are complete after it).
        max_step_chunks: most non-resident chunks one step needs.
    """

    steps: list[tuple[int, ...]]
    flops_share: list[float]
    first_use: list[int]
    last_use: list[int]
    max_step_chunks: int


def chunk_trace(
    profile: ModelProfile,
    layout: ChunkLayout,
    every: int,
    micro_batches: int = 1,
    module_trace: list[tuple[list[int], int]] | None = None,
) -> ChunkTrace:
    """Maps the module trace to chunks, merging steps that cannot miss.

    Args:
        profile: the model profile.
        layout: the chunk layout.
        every: checkpointing (0 none, k every k-th block).
        micro_batches: > 1 for one layered step of that many micro-batches: forward and backward
            steps carry all of their FLOPs, and each checkpointed block's forward and
            recomputation run once per micro-batch.
        module_trace: ``checkpointed_trace(profile, every, micro_batches)`` when the caller keeps it
            (it does not depend on the chunk size).

    Returns:
        The merged chunk trace of one micro-batch.
    """
    chunk_of = layout.chunk_of_param
    resident = [chunk.resident for chunk in layout.chunks]
    numel = [p.numel for p in profile.params]
    steps: list[tuple[int, ...]] = []
    weights: list[float] = []
    first_use = [-1] * layout.num_chunks
    last_use = [-1] * layout.num_chunks
    previous: set[int] | None = None
    # The trace repeats its parameter lists (the same list objects: backward and recomputation of a
    # forward, a layered step's micro-batches), so each list's chunks and elements are worked out once.
    seen: dict[int, tuple[set[int], set[int], int]] = {}
    if module_trace is None:
        module_trace = checkpointed_trace(profile, every, micro_batches)
    for params, kind in module_trace:
        known = seen.get(id(params))
        if known is None:
            touched = {chunk_of[i] for i in params if chunk_of[i] >= 0}
            known = seen[id(params)] = (touched, {c for c in touched if not resident[c]}, sum(numel[i] for i in params))
        touched, cacheable, params_numel = known
        copies = 1 if kind in _ONE_MICRO_BATCH else micro_batches
        weight = copies * _KIND_FLOPS[kind] * params_numel
        if previous is not None and cacheable <= previous:
            weights[-1] += weight
        else:
            steps.append(tuple(sorted(cacheable)))
            weights.append(weight)
            previous = cacheable
        position = len(steps) - 1
        for chunk in touched:
            if first_use[chunk] < 0:
                first_use[chunk] = position
            last_use[chunk] = position
    total = sum(weights) or 1.0
    return ChunkTrace(
        steps=steps,
        flops_share=[w / total for w in weights],
        first_use=first_use,
        last_use=last_use,
        max_step_chunks=max((len(s) for s in steps), default=0),
    )
