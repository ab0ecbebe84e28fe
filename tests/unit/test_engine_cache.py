"""The cache of gathered chunks: slots, furthest-next-use eviction, recorded access order, prefetch."""

from __future__ import annotations

import torch

from elixir_tune.engine.chunks.cache import CacheTooSmall, ChunkCache
from elixir_tune.engine.chunks.chunk import Chunk
from elixir_tune.engine.comm import Comm

LOCAL = Comm(0, 1, "local", torch.device("cpu"))


def make_chunks(n: int) -> list[Chunk]:
    chunks = []
    for i in range(n):
        param = torch.nn.Parameter(torch.full((4,), float(i)))
        chunk = Chunk(i, [(f"p{i}", param)], 8, LOCAL, torch.float32, torch.device("cpu"), False, False)
        chunk.init_master(chunk.flat_from_params())
        chunks.append(chunk)
    return chunks


def nan(chunk):
    return torch.full((1,), float("nan"))


def held(cache):
    return sorted(cache.held)


def test_furthest_next_use_in_the_plan_order():
    chunks = make_chunks(4)
    cache = ChunkCache(chunks, 2, 0, nan)  # plan order: forward 0 1 2 3, backward 3 2 1 0
    cache.start_microbatch()
    for i in range(3):
        cache.fetch([chunks[i]], f"m{i}")
    # At chunk 2, chunk 0 is next used last in backward, chunk 1 sooner: 0 went.
    assert held(cache) == [1, 2]
    assert torch.equal(chunks[2].slots[0].param.data, torch.full((4,), 2.0))
    assert torch.isnan(chunks[0].slots[0].param.data).all()  # released parameters read NaN
    assert chunks[0].payload_bytes() == 0


def test_recorded_order_replaces_the_plan_order():
    chunks = make_chunks(3)
    cache = ChunkCache(chunks, 2, 0, nan)
    cache.start_microbatch()
    for i in (0, 1, 0, 2, 2, 1):
        cache.fetch([chunks[i]], "m")
    cache.finish_recording()
    assert cache.trace == [0, 1, 0, 2, 1]
    cache.start_microbatch()
    cache.fetch([chunks[0]], "m")
    cache.fetch([chunks[1]], "m")
    cache.fetch([chunks[0]], "m")
    cache.fetch([chunks[2]], "m")  # needs a slot: 0 is not used again this micro-batch, 1 is
    assert held(cache) == [1, 2]


def test_prefetch_gathers_ahead_within_the_slots():
    chunks = make_chunks(4)
    cache = ChunkCache(chunks, 3, 2, nan)
    cache.start_microbatch()
    cache.fetch([chunks[0]], "m0")
    assert set(cache.inflight) == {1, 2}  # the next two in the access order
    cache.fetch([chunks[1]], "m1")
    assert chunks[1].fresh and 1 not in cache.inflight
    # Chunk 3 is prefetched in place of chunk 0, whose next use (backward) comes later.
    assert set(cache.inflight) == {2, 3} and held(cache) == [1, 2, 3]
    assert cache.gathers == 4


def test_a_module_needing_more_chunks_than_slots_is_named():
    chunks = make_chunks(3)
    cache = ChunkCache(chunks, 1, 0, nan)
    cache.start_microbatch()
    try:
        cache.fetch([chunks[0], chunks[1]], "transformer.h.0.attn")
    except CacheTooSmall as exc:
        assert "transformer.h.0.attn" in str(exc) and "cache_blocks=1" in str(exc)
    else:
        raise AssertionError("expected CacheTooSmall")


def test_invalidate_keeps_slots_and_regathers_in_place():
    chunks = make_chunks(2)
    cache = ChunkCache(chunks, 2, 0, nan)
    cache.start_microbatch()
    cache.fetch([chunks[0]], "m")
    chunks[0].master.add_(1.0)  # an optimizer step
    cache.invalidate()
    assert not chunks[0].fresh and chunks[0].payload_bytes() > 0
    cache.fetch([chunks[0]], "m")
    assert torch.equal(chunks[0].slots[0].param.data, torch.full((4,), 1.0))
