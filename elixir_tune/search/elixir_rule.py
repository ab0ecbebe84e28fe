"""Elixir's own rule (the Elixir paper's search and its released code), as a baseline scored by our cost model.

1. GPU budget = 0.95 x (GPU memory - 2 GiB driver - buffers - 1.25 x peak activations), with
   activation checkpointing on and no gradient accumulation (Elixir has none).
2. Chunk sizes from 32 Mi elements, doubled until the largest parameter fits, up to 3x that, in
   a few steps; for each, the budget left after resident chunks gives the cache blocks (minus 2
   for prefetch); a furthest-next-use replay counts moved elements; the size with the fewest wins.
3. A fixed-constant test decides whether spare memory goes to cache blocks first or to keeping
   optimizer shards on the GPU; shards are then placed greedily in chunk order, the rest on the
   host. Constants (n = GPUs per node): host->GPU 16.3n+8.7 GB/s, GPU->host 15.8n+2.3 GB/s,
   GPU Adam 50n GB/s, CPU Adam 1.66 ln n + 5.15 GB/s; bandwidths and Adam rates are read as GB/s
   of the node and Adam as GB/s of fp32 parameters (our reading; the reference does not say).
"""

from __future__ import annotations

import math

from elixir_tune.costmodel.cache import simulate_cache
from elixir_tune.costmodel.layout import largest_param_numel
from elixir_tune.costmodel.memory import SHARD_BYTES, activation_bytes
from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.plan.memory import chunk_size_multiple
from elixir_tune.plan.schema import DTYPE_BYTES
from elixir_tune.search.space import round_up

_DRIVER_BYTES = 2 * 2**30
_CHUNK_STEPS = 8


def _budget_bytes(model: CostModel, micro_batch_size: int, every: int, selective: bool) -> float:
    hardware = model.hardware
    activations = activation_bytes(model.profile, micro_batch_size, every, model.dtype, selective=selective)
    return 0.95 * (hardware.gpu_memory_bytes - _DRIVER_BYTES - model.profile.buffers_bytes - 1.25 * activations)


def _candidate_sizes(model: CostModel) -> list[int]:
    world = model.world_size
    largest = largest_param_numel(model.profile)
    minimum = 32 * 2**20
    while minimum < largest:
        minimum *= 2
    step = max(world, (3 * minimum - minimum) // _CHUNK_STEPS)
    return sorted({round_up(minimum + i * step, chunk_size_multiple(world)) for i in range(_CHUNK_STEPS + 1)})


def _moved_elements(model: CostModel, chunk_size: int, every: int, cache_blocks: int) -> int:
    trace = model.trace(chunk_size, every)
    sim = simulate_cache(trace.steps, cache_blocks, model.layout(chunk_size).num_cacheable)
    return len(sim.cold) * chunk_size


def elixir_shape(
    model: CostModel, per_rank_batch: int, fixed: dict | None = None, budget_cut_bytes: float = 0.0
) -> Shape:
    """The plan shape Elixir's rule picks.

    Args:
        model: the cost model.
        per_rank_batch: samples per rank per step (one micro-batch: no accumulation).
        fixed: pinned choices; ``checkpointing`` (its mode too) and ``micro_batch_size`` are honoured.
        budget_cut_bytes: taken off the rule's GPU budget (the caller's way to make the rule's
            choice fit what our engine holds beside it; see ``fitted_elixir_shape``).

    Returns:
        The shape (not checked against our memory model; the caller scores it).
    """
    fixed = fixed or {}
    every = fixed.get("checkpointing", 1 if model.profile.blocks else 0)
    micro_batch = fixed.get("micro_batch_size", per_rank_batch)
    accum = per_rank_batch // micro_batch
    selective = fixed.get("checkpoint_mode") == "selective" and every > 0
    budget = _budget_bytes(model, micro_batch, every, selective) - budget_cut_bytes
    dtype_bytes = DTYPE_BYTES[model.dtype]
    world = model.world_size
    best = None
    for chunk_size in _candidate_sizes(model):
        layout = model.layout(chunk_size)
        chunk_bytes = chunk_size * dtype_bytes
        minimum = model.min_cache_blocks(chunk_size, every)
        blocks = int((budget - layout.num_resident * chunk_bytes) // chunk_bytes) - 2
        blocks = max(minimum, min(blocks, layout.num_cacheable))
        moved = _moved_elements(model, chunk_size, every, blocks) if layout.num_cacheable else 0
        if best is None or moved < best[0]:
            best = (moved, chunk_size, minimum)
    assert best is not None, "Elixir's rule always has chunk sizes to try"
    _moved, chunk_size, minimum = best
    layout = model.layout(chunk_size)
    chunk_bytes = chunk_size * dtype_bytes
    shard_bytes = chunk_size // world * SHARD_BYTES
    free = budget - layout.num_resident * chunk_bytes
    n = model.gpus_per_node
    upload_bps = (16.3 * n + 8.7) * 1e9 / n
    download_bps = (15.8 * n + 2.3) * 1e9 / n
    gpu_adam = (50.0 * n) * 1e9 / 4 / n
    cpu_adam = (1.66 * math.log(n) + 5.15) * 1e9 / 4 / n

    def split(cache_first: bool) -> tuple[int, int]:
        """(cache blocks, shards kept on the GPU)."""
        if cache_first:
            blocks = max(minimum, min(layout.num_cacheable, int(free // chunk_bytes)))
            on_gpu = int(max(0.0, free - blocks * chunk_bytes) // shard_bytes)
        else:
            blocks = min(layout.num_cacheable, minimum + 1)
            on_gpu = int(max(0.0, free - blocks * chunk_bytes) // shard_bytes)
            on_gpu = min(on_gpu, layout.num_chunks)
            spare = free - blocks * chunk_bytes - on_gpu * shard_bytes
            blocks = min(layout.num_cacheable, blocks + max(0, int(spare // chunk_bytes)))
        return blocks, min(on_gpu, layout.num_chunks)

    def rule_time(blocks: int, on_gpu: int) -> float:
        offloaded = layout.num_chunks - on_gpu
        shard_numel = chunk_size // world
        moved = _moved_elements(model, chunk_size, every, blocks) if layout.num_cacheable else 0
        offloaded_share = offloaded / layout.num_chunks
        upload = moved * offloaded_share / world * dtype_bytes / upload_bps
        download = offloaded * shard_numel * dtype_bytes / download_bps
        return upload + download + offloaded * shard_numel / cpu_adam + on_gpu * shard_numel / gpu_adam

    options = [split(True), split(False)]
    blocks, on_gpu = min(options, key=lambda option: rule_time(*option))
    if layout.num_cacheable == 0:
        blocks = 0
    prefetch = 1 if blocks >= minimum + 1 and blocks > 1 else 0
    offloaded = tuple(range(on_gpu, layout.num_chunks))
    return Shape(
        chunk_size,
        blocks,
        len(offloaded),
        prefetch,
        every,
        micro_batch,
        accum,
        offloaded=offloaded,
        selective=selective,
    )


def fitted_elixir_shape(model: CostModel, per_rank_batch: int, usable_gpu_bytes: int, fixed: dict | None = None):
    """Elixir's rule with its budget cut until its choice fits our memory model.

    The rule budgets for Elixir's own engine (2 GiB for the driver, 5% slack); ours also holds a
    staging pool and keeps a margin free (costmodel/memory.py), so the rule's choice can overshoot
    the device. As a baseline it is given the same memory: its budget shrinks by the overshoot until
    the shape fits (a few rounds at most), so that the comparison is of choices, not of accounting.

    Returns:
        (shape, memory estimate); the last shape tried when none fits (the caller reports it).
    """
    cut = 0.0
    for _ in range(8):
        shape = elixir_shape(model, per_rank_batch, fixed, budget_cut_bytes=cut)
        memory = model.memory(shape)
        over = memory.required_gpu_bytes - usable_gpu_bytes
        if over <= 0:
            break
        cut += over
    return shape, memory
