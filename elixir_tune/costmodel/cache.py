"""The chunk cache: furthest-next-use (Belady) eviction over the access trace.

The engine holds ``cache_blocks`` gathered non-resident chunks; when a step needs a chunk that is
not cached it evicts the cached chunk whose next use is furthest away (never one the step itself
needs). Belady's rule is optimal for demand fetching, which a brute-force test checks.

The simulation only depends on the chunk size, the checkpointing (both fix the trace) and the
cache size, so the search runs it once per such triple and reuses it for every candidate that
differs only in offload, prefetch or micro-batch size.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

_NEVER = 1 << 60


def belady(
    steps: list[tuple[int, ...]], cache_blocks: int, cached: dict[int, int] | None = None
) -> tuple[list[tuple[int, int, int]], dict[int, int]]:
    """Replays steps through a furthest-next-use cache.

    Args:
        steps: per step, the chunks it needs gathered at once.
        cache_blocks: how many chunks the cache holds; at least the largest step.
        cached: chunks already cached -> step of their last use (negative: before this trace).

    Returns:
        (fetches, cached at the end): fetches as (step, chunk, free_after_step), where
        free_after_step is the last step that used the evicted chunk (-1 when the block was free
        or its chunk was last used before this trace).
    """
    if steps and max(map(len, steps)) > cache_blocks:
        raise ValueError(f"a step needs more than {cache_blocks} chunks at once")
    next_use: list[list[int]] = [[]] * len(steps)
    seen: dict[int, int] = {}
    get = seen.get
    for position in range(len(steps) - 1, -1, -1):
        step = steps[position]
        next_use[position] = [get(chunk, _NEVER) for chunk in step]
        for chunk in step:
            seen[chunk] = position
    last_used = dict(cached or {})
    upcoming = {chunk: seen.get(chunk, _NEVER) for chunk in last_used}
    heap = [(-use, chunk) for chunk, use in upcoming.items()]
    heapq.heapify(heap)
    # Local names: the search replays thousands of traces (each step's chunks pushed once).
    push, pop, next_of = heapq.heappush, heapq.heappop, upcoming.get
    fetches = []
    for position, step in enumerate(steps):
        for chunk in step:
            if chunk in upcoming:
                continue
            free_after = -1
            if len(upcoming) >= cache_blocks:
                while True:
                    negative_use, victim = pop(heap)
                    if next_of(victim) == -negative_use:
                        break
                del upcoming[victim]
                free_after = max(last_used.pop(victim), -1)
            fetches.append((position, chunk, free_after))
            upcoming[chunk] = position
        for chunk, use in zip(step, next_use[position]):  # noqa: B905 (equal lengths: built from step above)
            upcoming[chunk] = use
            last_used[chunk] = position
            push(heap, (-use, chunk))
    return fetches, last_used


@dataclass
class CacheSim:
    """Fetches of one micro-batch from a cold cache and of one in steady state.

    Attributes:
        cold: fetches (step, chunk, free_after_step) of the first micro-batch of a step.
        steady: the same for each later micro-batch (the cache is warm from the previous one).
    """

    cold: list[tuple[int, int, int]]
    steady: list[tuple[int, int, int]]


def simulate_cache(steps: list[tuple[int, ...]], cache_blocks: int, num_cacheable: int) -> CacheSim:
    """Cold and steady-state fetches of one micro-batch.

    Args:
        steps: the chunk trace of one micro-batch.
        cache_blocks: cache size in chunks.
        num_cacheable: how many non-resident chunks there are.

    Returns:
        The fetch lists.
    """
    if cache_blocks >= num_cacheable:
        first: dict[int, int] = {}
        for position, step in enumerate(steps):
            for chunk in step:
                first.setdefault(chunk, position)
        return CacheSim(cold=[(p, c, -1) for c, p in sorted(first.items(), key=lambda item: item[1])], steady=[])
    length = len(steps)
    # Three micro-batches in one replay, so that evictions look ahead into the next micro-batch;
    # the middle one is the steady state.
    fetches, _ = belady(steps * 3, cache_blocks)
    cold = [f for f in fetches if f[0] < length]
    second = [
        (p - length, c, free - length if free >= length else -1) for p, c, free in fetches if length <= p < 2 * length
    ]
    return CacheSim(cold=cold, steady=second)
