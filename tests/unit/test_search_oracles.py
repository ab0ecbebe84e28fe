"""Oracles for two choices of the search (docs/costmodel-and-search.md, decision map):

* which chunks are offloaded: for every count, the chosen chunks must be the ones whose shards
  cross host->device least often in a step (measured through the timeline simulation, one chunk
  at a time), ties going to the later chunk (its gradients are reduced earliest in backward);
* the pruned joint search: on spaces small enough to score every candidate, it must return the
  same best candidate as scoring them all.

The profiles are analytic (costmodel.synthetic) and small, so this runs in a few seconds.
"""

from __future__ import annotations

import dataclasses

import pytest

from elixir_tune.costmodel.layout import largest_trainable_numel
from elixir_tune.costmodel.memory import NCCL_BUFFER_BYTES
from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.costmodel.synthetic import example_hardware, gpt2_profile
from elixir_tune.search import InfeasibleError, parse_fixed, search
from elixir_tune.search.candidate import score
from elixir_tune.search.joint import (
    cache_choices,
    checkpointing_choices,
    chunk_sizes,
    micro_batch_choices,
    prefetch_choices,
)
from elixir_tune.search.layouts import layout_choices
from elixir_tune.search.space import chunk_size_grid
from elixir_tune.search.stages import StageScorer

MIB = 2**20


@pytest.fixture(scope="module")
def small_profile():
    # 4 blocks, tied embeddings (one resident chunk); 3 to 22 chunks over the chunk-size grid.
    return gpt2_profile("small", hidden=128, layers=4, heads=4, vocab=512, positions=64, seq_len=64, dtype="fp32")


# ---------------------------------------------------------------------------------------------
# Which chunks are offloaded
# ---------------------------------------------------------------------------------------------


def host_to_device_copies(model: CostModel, shape: Shape, chunk: int) -> int:
    """Times chunk's shard is copied host->device in one step, had it alone been offloaded: read off
    the simulated timeline's host->device busy time."""
    alone = dataclasses.replace(shape, num_offloaded=1, offloaded=(chunk,))
    busy_s = model.step_time(alone).breakdown["h2d_s"]
    copies = busy_s / model.costs(shape.chunk_size).h2d_s
    assert copies == pytest.approx(round(copies), abs=1e-6)
    return round(copies)


def grid_sizes(model: CostModel) -> list[int]:
    """The search's 1.5x chunk-size grid (without the least-padded sizes ``chunk_sizes`` adds)."""
    largest = largest_trainable_numel(model.profile)
    trainable = sum(p.numel for p in model.profile.params if p.requires_grad and not p.shared)
    return chunk_size_grid(largest, max(trainable, largest), model.data_size)


def offload_cases(profile):
    """(cost model, shape without offload) for every cache size of two chunk sizes, two world
    sizes and checkpointing off/all; two micro-batches so that the steady state counts too."""
    for gpus in (1, 2):
        model = CostModel(profile, example_hardware(gpu_memory_gib=4, gpus_per_node=gpus), gpus)
        for chunk_size in grid_sizes(model)[1:3]:
            cacheable = model.layout(chunk_size).num_cacheable
            for every in (0, 1):
                for cache_blocks in range(model.min_cache_blocks(chunk_size, every), cacheable + 1):
                    yield model, Shape(chunk_size, cache_blocks, 0, 0, every, 2, 2)


def test_offloaded_chunks_are_the_least_fetched_latest_first(small_profile):
    checked = varied = 0
    for model, shape in offload_cases(small_profile):
        num_chunks = model.layout(shape.chunk_size).num_chunks
        copies = [host_to_device_copies(model, shape, chunk) for chunk in range(num_chunks)]
        varied += len(set(copies)) > 1
        for count in range(1, num_chunks):
            mask = model.offload_mask(dataclasses.replace(shape, num_offloaded=count))
            chosen = [chunk for chunk in range(num_chunks) if mask[chunk]]
            kept = [chunk for chunk in range(num_chunks) if not mask[chunk]]
            assert len(chosen) == count
            where = f"{shape}, copies per chunk {copies}, offloaded {chosen}"
            # The least host->device traffic any `count` chunks can have...
            assert sum(copies[c] for c in chosen) == sum(sorted(copies)[:count]), where
            # ...and among chunks copied equally often, the later ones go first.
            for a in chosen:
                for b in kept:
                    assert copies[a] < copies[b] or (copies[a] == copies[b] and a > b), where
            # The whole step's host->device traffic is what the chosen chunks add up to.
            step_copies = model.step_time(dataclasses.replace(shape, num_offloaded=count)).breakdown["h2d_s"]
            assert step_copies == pytest.approx(sum(copies[c] for c in chosen) * model.costs(shape.chunk_size).h2d_s)
            checked += 1
    assert checked > 100 and varied > 10  # the cases do tell chunks apart


def test_offload_choice_by_hand(small_profile):
    """One case read off by hand: 13 chunks (chunk 0 the resident tied embedding), one cache slot,
    no checkpointing, two micro-batches. With one slot, Belady keeps the chunk at the turn of
    forward and backward, so chunk 12 is fetched once per micro-batch (2 copies), chunk 1 (first in
    forward, last in backward) 3 times, the middle ones 4 times; the resident chunk 0 once."""
    model = CostModel(small_profile, example_hardware(gpu_memory_gib=4, gpus_per_node=1), 1)
    chunk_size = grid_sizes(model)[1]
    shape = Shape(chunk_size, 1, 0, 0, 0, 2, 2)
    assert model.layout(chunk_size).num_chunks == 13
    assert [host_to_device_copies(model, shape, c) for c in range(13)] == [1, 3] + [4] * 10 + [2]

    def offloaded(count: int) -> list[int]:
        mask = model.offload_mask(dataclasses.replace(shape, num_offloaded=count))
        return [chunk for chunk in range(13) if mask[chunk]]

    assert offloaded(1) == [0]
    assert offloaded(2) == [0, 12]
    assert offloaded(3) == [0, 1, 12]
    assert offloaded(5) == [0, 1, 10, 11, 12]  # then the latest of the chunks fetched 4 times
    # Every chunk cached: each is fetched once, so the latest go first.
    all_cached = dataclasses.replace(shape, cache_blocks=12)
    mask = model.offload_mask(dataclasses.replace(all_cached, num_offloaded=3))
    assert [chunk for chunk in range(13) if mask[chunk]] == [10, 11, 12]


# ---------------------------------------------------------------------------------------------
# The pruned joint search against scoring every candidate
# ---------------------------------------------------------------------------------------------


def every_shape(model: CostModel, per_rank: int, fixed: dict):
    """Every candidate shape of the search space: the search's own grids, and every offload count."""
    for chunk_size in chunk_sizes(model, fixed):
        layout = model.layout(chunk_size)
        for every in checkpointing_choices(model, fixed):
            minimum = model.min_cache_blocks(chunk_size, every)
            for micro_batch in micro_batch_choices(per_rank, fixed):
                accum = per_rank // micro_batch
                layered_choices = (False, True) if accum > 1 and fixed.get("accumulation") != "standard" else (False,)
                if model.parallel_layout.pipeline > 1 and accum > 1:
                    layered_choices = (True,)  # a pipeline's breadth-first schedule is layered
                for layered in layered_choices:
                    for cache_blocks in cache_choices(minimum, layout.num_cacheable, fixed):
                        for prefetch in prefetch_choices(cache_blocks, minimum, layout.num_cacheable, fixed):
                            for offloaded in range(layout.num_chunks + 1):
                                yield Shape(
                                    chunk_size,
                                    cache_blocks,
                                    offloaded,
                                    prefetch,
                                    every,
                                    micro_batch,
                                    accum,
                                    layered=layered,
                                )


class ExhaustiveSpace:
    """Every candidate of every parallel layout of one space (GPUs, global batch, pins), scored once.

    The cost model reads neither the device memory a rank may use nor the host's (only the search's
    budget does), so the budgets of one space share its cost models, every shape's memory and every
    score; ``best`` still filters and ranks every candidate for each budget (no bound, no early stop).
    """

    def __init__(self, profile, hardware, gpus: int, global_batch: int, fixed: dict):
        self.hardware, self.global_batch = hardware, global_batch
        self.layouts = []  # (cost model, stage scorer, [(shape, memory)])
        for layout in layout_choices(profile, gpus, 1, global_batch, fixed):
            model = CostModel(profile, hardware, gpus, dtype=fixed.get("dtype"), layout=layout)
            # Per data index: the ranks of a context group share their samples (model.data_size is data x context).
            per_index = global_batch // (model.data_size // layout.context)
            shapes = [(shape, model.memory(shape)) for shape in every_shape(model, per_index, fixed)]
            self.layouts.append((model, StageScorer(model), shapes))
        self._scores: dict[tuple[int, int], object] = {}

    def score(self, layout_index: int, shape_index: int):
        """The critical stage's scored candidate (computed on first use)."""
        key = (layout_index, shape_index)
        if key not in self._scores:
            model, _, shapes = self.layouts[layout_index]
            shape, memory = shapes[shape_index]
            self._scores[key] = score(model, shape, memory, self.global_batch)
        return self._scores[key]

    def best(self, hardware):
        """Scores every candidate that fits ``hardware``'s device and host memory.

        Args:
            hardware: this space's hardware with other memory limits (nothing else may differ).

        Returns:
            ((step time, device bytes, host bytes), candidate) of the best (None when nothing fits), and
            how many were scored.
        """
        limits = {"usable_memory_bytes": 0, "host_memory_bytes": 0}
        assert dataclasses.replace(hardware, **limits) == dataclasses.replace(self.hardware, **limits)
        usable, host = hardware.usable_memory_bytes, hardware.host_memory_bytes
        best, scored = None, 0
        for layout_index, (_model, scorer, shapes) in enumerate(self.layouts):
            for shape_index, (_shape, memory) in enumerate(shapes):
                # required = the peak plus the margin the search keeps free (costmodel.memory.margin_bytes)
                if memory.required_gpu_bytes > usable or memory.peak_host_bytes > host:
                    continue
                candidate = self.score(layout_index, shape_index)
                # A pipeline runs at its slowest stage's pace and fits only if every stage fits.
                whole = scorer.whole(candidate, self.global_batch, usable, host)
                if whole is None:
                    continue
                scored += 1
                key = key_of(whole)
                if best is None or key < best[0]:
                    best = (key, whole)
        return best, scored


@pytest.fixture(scope="module")
def exhaustive_spaces(small_profile):
    """``ExhaustiveSpace`` per (GPUs, pins), made on first use and shared by the budgets of the test below
    (dropped with the module: they hold every shape's memory and score)."""
    spaces: dict[tuple, ExhaustiveSpace] = {}

    def space_of(gpus: int, fixed: dict, loss: float = 0.0) -> ExhaustiveSpace:
        key = (gpus, tuple(sorted(fixed.items())), loss)
        if key not in spaces:
            hardware = dataclasses.replace(
                example_hardware(gpu_memory_gib=4, gpus_per_node=gpus), collective_compute_loss=loss
            )
            spaces[key] = ExhaustiveSpace(small_profile, hardware, gpus, 4 * gpus, parse_fixed(fixed))
        return spaces[key]

    return space_of


def key_of(candidate):
    return (candidate.step_time_s, candidate.memory.peak_gpu_bytes, candidate.memory.peak_host_bytes)


# Device memory a rank may use, in MiB: the search keeps a margin of 1 GiB free on this node (its
# allocator overhead), plus NCCL's buffers (NCCL_BUFFER_BYTES) with 2 GPUs, so 1030-1038 (plus
# those) leave 6-14 MiB for a model whose states take about 14 MiB (offload is forced), 1200
# leaves room for everything.
LOOP = "forward_backward"
SPACES = [
    (gpus, usable_mib, fixed)
    for gpus in (1, 2)
    for usable_mib in (1030, 1034, 1038, 1200)
    for fixed in ({}, {"checkpointing": "none"})
]


# The collectives' cost to compute (collective_compute_loss) adds to the pruning bound: checked with it on.
SPACES += [
    (2, usable_mib, dict(fixed, loss=0.8)) for usable_mib in (1030, 1200) for fixed in ({}, {"checkpointing": "none"})
]


@pytest.mark.parametrize("gpus,usable_mib,fixed", SPACES, ids=[f"{g}gpu-{u}MiB-{f}" for g, u, f in SPACES])
def test_pruned_search_finds_the_exhaustive_best(small_profile, exhaustive_spaces, gpus, usable_mib, fixed):
    fixed = dict(fixed)
    loss = fixed.pop("loss", 0.0)
    nccl_bytes = NCCL_BUFFER_BYTES if gpus > 1 else 0
    node = dataclasses.replace(
        example_hardware(gpu_memory_gib=4, gpus_per_node=gpus),
        usable_memory_bytes=usable_mib * MIB + nccl_bytes,
        collective_compute_loss=loss,
    )
    global_batch = 4 * gpus
    space = exhaustive_spaces(gpus, fixed, loss)
    # top_k=1: the bounds are checked against the best so far, the most pruning they can do.
    # forward_backward: the whole space, layered accumulation included (the plain loop pins it standard).
    result = search(
        small_profile, node, gpus_per_node=gpus, global_batch_size=global_batch, fixed=fixed, top_k=1, loop=LOOP
    )
    (best_key, best), scored = space.best(node)
    assert key_of(result.candidates[0]) == best_key, (result.candidates[0].shape, best.shape)
    # The pruning never scores more than every candidate (in the tightest spaces it may skip none).
    assert result.num_scored <= scored

    # The same space with host memory just below what the winner needs: the host bound decides.
    if best.memory.peak_host_bytes > 0:
        tight = dataclasses.replace(node, host_memory_bytes=best.memory.peak_host_bytes - 1)
        expected, _ = space.best(tight)
        if expected is None:
            with pytest.raises(InfeasibleError):
                search(small_profile, tight, gpus_per_node=gpus, global_batch_size=global_batch, fixed=fixed, loop=LOOP)
        else:
            found = search(
                small_profile,
                tight,
                gpus_per_node=gpus,
                global_batch_size=global_batch,
                fixed=fixed,
                top_k=1,
                loop=LOOP,
            )
            assert key_of(found.candidates[0]) == expected[0], (found.candidates[0].shape, expected[1].shape)
