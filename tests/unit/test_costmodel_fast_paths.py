"""The cost model's hot functions give exactly what they gave before they were made faster.

``issue_steps`` and ``simulate_micro_batch`` run in the search's inner loop; their builtin ``max``/``min``
calls became comparisons and ``CostModel`` caches each fetch list's issue steps. ``belady`` builds its
next-use lists without tuples, ``chunk_trace`` works out each repeated parameter list once. The reference copies
below are the functions as they were (docstrings left out); the fast ones must agree with them to the
last bit on random timelines, every option on, and a cost model's step must not depend on the order
its caches were filled in.
"""

from __future__ import annotations

import dataclasses
import heapq
import random

from elixir_tune.costmodel.cache import _NEVER, belady
from elixir_tune.costmodel.layout import ChunkLayout, pack_chunks
from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.costmodel.synthetic import example_hardware, gpt2_profile
from elixir_tune.costmodel.timeline import (
    LEFTOVER_ZERO,
    MicroBatchTime,
    TransferCosts,
    issue_steps,
    simulate_micro_batch,
)
from elixir_tune.costmodel.trace import _KIND_FLOPS, _ONE_MICRO_BATCH, ChunkTrace, checkpointed_trace, chunk_trace
from elixir_tune.profiler.schema import ModelProfile


def reference_issue_steps(fetches: list[tuple[int, int, int]], prefetch: int) -> list[int]:
    """``issue_steps`` as it was."""
    out = []
    for index, (step, _chunk, free_after) in enumerate(fetches):
        earliest = fetches[index - prefetch][0] if index >= prefetch else 0
        out.append(min(step, max(earliest, free_after + 1)))
    return out


def reference_simulate_micro_batch(
    step_compute_s: list[float],
    fetches: list[tuple[int, int, int]],
    issue: list[int],
    reduce_after: list[tuple[int, ...]],
    offloaded: list[bool],
    costs: TransferCosts,
    shared_compute: bool = False,
    shared_link: bool = False,
    record: list[tuple[str, float, float, int]] | None = None,
    busy_s: tuple[float, float, float, float] = LEFTOVER_ZERO,
    chunk_costs: dict[int, TransferCosts] | None = None,
) -> MicroBatchTime:
    """``simulate_micro_batch`` as it was."""
    num_steps = len(step_compute_s)
    issued_at: list[list[int]] = [[] for _ in range(num_steps)]
    for index, step in enumerate(issue):
        issued_at[step].append(index)
    needed = [0.0] * num_steps
    h2d_s, d2h_s = costs.h2d_s, costs.d2h_s
    # h2d_free / d2h_free: the inbound / outbound host link of this GPU.
    coll_free, h2d_free, d2h_free, host_free = busy_s
    end = exposed = 0.0
    h2d_count = d2h_count = 0
    gathered_s = reduced_s = 0.0
    for step in range(num_steps):
        for index in issued_at[step]:
            fetch_step, chunk, _free = fetches[index]
            gather_s = chunk_costs[chunk].allgather_s if chunk_costs and chunk in chunk_costs else costs.allgather_s
            ready = end
            if offloaded[chunk]:
                h2d_free = (h2d_free if h2d_free > ready else ready) + h2d_s
                ready = h2d_free
                h2d_count += 1
                if record is not None:
                    record.append(("host-to-device", h2d_free - h2d_s, h2d_free, chunk))
            if shared_compute:  # the gather stalls the compute stream while it runs
                start = end if end > ready else ready
                exposed += start + gather_s - end
                end = coll_free = start + gather_s
            else:
                coll_free = max(coll_free, ready, h2d_free, d2h_free) if shared_link else max(coll_free, ready)
                coll_free += gather_s
            if record is not None:
                record.append(("all-gather", coll_free - gather_s, coll_free, chunk))
            if shared_link:
                h2d_free = d2h_free = coll_free
            gathered_s += gather_s
            if coll_free > needed[fetch_step]:
                needed[fetch_step] = coll_free
        if needed[step] > end:
            exposed += needed[step] - end
            end = needed[step]
        end += step_compute_s[step]
        if record is not None:
            record.append(("compute", end - step_compute_s[step], end, step))
        for chunk in reduce_after[step]:
            rs_s = (
                chunk_costs[chunk].reduce_scatter_s if chunk_costs and chunk in chunk_costs else costs.reduce_scatter_s
            )
            coll_free = max(coll_free, end, h2d_free, d2h_free) if shared_link else max(coll_free, end)
            coll_free += rs_s
            if record is not None:
                record.append(("reduce-scatter", coll_free - rs_s, coll_free, chunk))
            if shared_link:
                h2d_free = d2h_free = coll_free
            if shared_compute:
                end = coll_free
            reduced_s += rs_s
            if offloaded[chunk]:
                d2h_free = (d2h_free if d2h_free > coll_free else coll_free) + d2h_s
                host_free = (host_free if host_free > d2h_free else d2h_free) + costs.host_add_s
                d2h_count += 1
                if record is not None:
                    record.append(("device-to-host", d2h_free - d2h_s, d2h_free, chunk))
                    if costs.host_add_s > 0:
                        record.append(("cpu optimizer", host_free - costs.host_add_s, host_free, chunk))
    return MicroBatchTime(
        compute_end_s=end,
        drained_s=max(end, coll_free, h2d_free, d2h_free, host_free),
        exposed_fetch_s=exposed,
        allgather_s=gathered_s,
        reduce_scatter_s=reduced_s,
        h2d_s=h2d_count * h2d_s,
        d2h_s=d2h_count * d2h_s,
        leftover_s=(
            max(0.0, coll_free - end),
            max(0.0, h2d_free - end),
            max(0.0, d2h_free - end),
            max(0.0, host_free - end),
        ),
    )


def reference_belady(
    steps: list[tuple[int, ...]], cache_blocks: int, cached: dict[int, int] | None = None
) -> tuple[list[tuple[int, int, int]], dict[int, int]]:
    """``belady`` as it was."""
    if any(len(step) > cache_blocks for step in steps):
        raise ValueError(f"a step needs more than {cache_blocks} chunks at once")
    next_use: list[tuple[int, ...]] = [()] * len(steps)
    seen: dict[int, int] = {}
    for position in range(len(steps) - 1, -1, -1):
        next_use[position] = tuple(seen.get(chunk, _NEVER) for chunk in steps[position])
        for chunk in steps[position]:
            seen[chunk] = position
    last_used = dict(cached or {})
    upcoming = {chunk: seen.get(chunk, _NEVER) for chunk in last_used}
    heap = [(-use, chunk) for chunk, use in upcoming.items()]
    heapq.heapify(heap)
    fetches = []
    for position, step in enumerate(steps):
        for chunk in step:
            if chunk in upcoming:
                continue
            free_after = -1
            if len(upcoming) >= cache_blocks:
                while True:
                    negative_use, victim = heapq.heappop(heap)
                    if upcoming.get(victim) == -negative_use:
                        break
                del upcoming[victim]
                free_after = max(last_used.pop(victim), -1)
            fetches.append((position, chunk, free_after))
            upcoming[chunk] = position
        for chunk, use in zip(step, next_use[position], strict=True):
            upcoming[chunk] = use
            last_used[chunk] = position
            heapq.heappush(heap, (-use, chunk))
    return fetches, last_used


def reference_chunk_trace(profile: ModelProfile, layout: ChunkLayout, every: int, micro_batches: int = 1) -> ChunkTrace:
    """``chunk_trace`` as it was."""
    chunk_of = layout.chunk_of_param
    resident = [chunk.resident for chunk in layout.chunks]
    numel = [p.numel for p in profile.params]
    steps: list[tuple[int, ...]] = []
    weights: list[float] = []
    first_use = [-1] * layout.num_chunks
    last_use = [-1] * layout.num_chunks
    previous: set[int] | None = None
    for params, kind in checkpointed_trace(profile, every, micro_batches):
        touched = {chunk_of[i] for i in params if chunk_of[i] >= 0}
        copies = 1 if kind in _ONE_MICRO_BATCH else micro_batches
        weight = copies * _KIND_FLOPS[kind] * sum(numel[i] for i in params)
        cacheable = {c for c in touched if not resident[c]}
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


def random_timeline(rng: random.Random) -> dict:
    """A random micro-batch: fetches in step order (each after the last use of the block it takes),
    chunks reduced after random steps, some offloaded, some with costs of their own."""
    num_steps, num_chunks = rng.randint(1, 12), rng.randint(1, 8)
    fetches, step = [], 0
    for _ in range(rng.randint(0, 14)):
        step = min(num_steps - 1, step + rng.choice((0, 0, 1, 2)))
        fetches.append((step, rng.randrange(num_chunks), rng.randint(-1, step - 1)))
    reduce_after = [tuple(rng.sample(range(num_chunks), rng.randint(0, min(2, num_chunks)))) for _ in range(num_steps)]

    def costs() -> TransferCosts:
        # Round numbers make ties (equal finish times) common: max() keeps the first of equals.
        return TransferCosts(*(rng.choice((0.0, 0.25, 0.5, rng.random())) for _ in range(6)))

    return {
        "step_compute_s": [rng.choice((0.0, 0.5, 1.0, rng.random())) for _ in range(num_steps)],
        "fetches": fetches,
        "reduce_after": reduce_after,
        "offloaded": [rng.random() < 0.5 for _ in range(num_chunks)],
        "costs": costs(),
        "shared_compute": rng.random() < 0.3,
        "shared_link": rng.random() < 0.5,
        "busy_s": tuple(rng.choice((0.0, 0.5, rng.random())) for _ in range(4)),
        "chunk_costs": {c: costs() for c in range(num_chunks) if rng.random() < 0.3} or None,
    }


def test_fast_timeline_equals_the_reference_bit_for_bit():
    rng = random.Random(20261125)
    exposed = shared = 0
    for _ in range(2000):
        case = random_timeline(rng)
        prefetch = rng.randint(0, 4)
        issue = issue_steps(case["fetches"], prefetch)
        assert issue == reference_issue_steps(case["fetches"], prefetch)
        fast_record: list = []
        reference_record: list = []
        fast = simulate_micro_batch(issue=issue, record=fast_record, **case)
        reference = reference_simulate_micro_batch(issue=issue, record=reference_record, **case)
        assert fast == reference  # dataclass equality: every float identical
        assert fast_record == reference_record
        exposed += fast.exposed_fetch_s > 0
        shared += case["shared_link"] and bool(case["fetches"])
    assert exposed > 200 and shared > 200  # the cases do exercise waiting and the shared link


def test_step_time_does_not_depend_on_the_order_the_caches_fill():
    """The issue steps are cached per (chunk size, checkpointing, cache, micro-batches, prefetch, cold or
    steady): shapes that differ in prefetch or offload only, scored in opposite orders on two fresh
    models, get the same steps (a key missing a field would hand one shape another's issue steps)."""
    profile = gpt2_profile("small", hidden=128, layers=4, heads=4, vocab=512, positions=64, seq_len=64, dtype="fp32")
    hardware = example_hardware(gpu_memory_gib=4, gpus_per_node=2)
    first = CostModel(profile, hardware, 2)
    chunk_size = first.largest_numel * 2
    cacheable = first.layout(chunk_size).num_cacheable
    minimum = first.min_cache_blocks(chunk_size, 0)
    shapes = [
        Shape(chunk_size, cache, offloaded, prefetch, every, 1, 4, layered=layered)
        for cache in (minimum, cacheable)
        for prefetch in (0, 1, 3)
        for offloaded in (0, 2)
        for every in (0, 1)
        for layered in (False, True)
    ]
    second = CostModel(profile, hardware, 2)
    forward = [first.step_time(shape) for shape in shapes]
    backward = [second.step_time(shape) for shape in reversed(shapes)][::-1]
    assert forward == backward
    # Prefetch does change the step of some shape here, so a key without it would have been caught.
    by_prefetch = {}
    for shape, estimate in zip(shapes, forward, strict=True):
        by_prefetch.setdefault(repr(dataclasses.replace(shape, prefetch=0)), set()).add(estimate.step_time_s)
    assert any(len(steps) > 1 for steps in by_prefetch.values())


def test_fast_belady_equals_the_reference():
    rng = random.Random(7)
    for _ in range(1000):
        num_chunks = rng.randint(1, 10)
        steps = [
            tuple(sorted(rng.sample(range(num_chunks), rng.randint(1, min(3, num_chunks)))))
            for _ in range(rng.randint(1, 15))
        ]
        cache_blocks = rng.randint(max(len(step) for step in steps), num_chunks + 1)
        cached = {
            c: rng.randint(-3, -1) for c in rng.sample(range(num_chunks), rng.randint(0, min(cache_blocks, num_chunks)))
        }
        assert belady(steps * 3, cache_blocks, cached) == reference_belady(steps * 3, cache_blocks, cached)


def test_fast_chunk_trace_equals_the_reference():
    """Every chunk size of the small GPT-2's grid and the 124M one, checkpointing none to every 3rd
    block, one to four micro-batches of a layered step (the repeated lists)."""
    profiles = [
        gpt2_profile("small", hidden=128, layers=4, heads=4, vocab=512, positions=64, seq_len=64, dtype="fp32"),
        gpt2_profile("gpt2"),
    ]
    compared = 0
    for profile in profiles:
        largest = max(p.numel for p in profile.params)
        sizes = (largest, 2 * largest, 5 * largest, sum(p.numel for p in profile.params))
        for every in (0, 1, 2, 3):
            for micro_batches in (1, 2, 4):
                # The cost model keeps one module trace per (checkpointing, micro-batches) for every chunk size.
                module_trace = checkpointed_trace(profile, every, micro_batches)
                for chunk_size in sizes:
                    layout = pack_chunks(profile, chunk_size)
                    expected = reference_chunk_trace(profile, layout, every, micro_batches)
                    assert chunk_trace(profile, layout, every, micro_batches) == expected
                    assert chunk_trace(profile, layout, every, micro_batches, module_trace) == expected
                    compared += 1
    assert compared == 96
