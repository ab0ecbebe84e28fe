"""On a CPU device, device and host are one memory: offload neither frees memory nor costs time (fp32),
and the search does not use it to fit (issue 23)."""

from __future__ import annotations

import pytest

from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.search import search

WORLD = 2
CHUNK = 1 << 22


@pytest.fixture(scope="module")
def profile():
    # 12.8M parameters, as issue 23's GPT-2 (tests/distributed/gpt2_13m.yaml): 5 chunks of 2^21.
    return gpt2_profile("gpt2-13m", hidden=512, layers=4, heads=8, vocab=256, positions=64, seq_len=64, dtype="fp32")


def pinned(profile, offload: float):
    fixed = dict(offload=offload, chunk_size=CHUNK, cache_blocks=2, prefetch=1, micro_batch_size=2, dtype="fp32")
    return search(profile, load_hardware("cpu"), gpus_per_node=WORLD, global_batch_size=8, fixed=fixed)


def test_offload_on_a_cpu_device_costs_no_byte_and_no_time_in_fp32(profile):
    plans = [pinned(profile, share).plan for share in (0.0, 0.5, 1.0)]
    assert [sum(c.offload for c in p.memory.chunks) for p in plans] == [0, 3, 5]  # the pins took (half of 5 rounds up)
    per_worker = {p.prediction.peak_gpu_bytes + p.prediction.peak_host_bytes // WORLD for p in plans}
    assert len(per_worker) == 1  # one pool: an offloaded shard moves its bytes, it adds none
    assert all(p.prediction.transient_bytes["landing_bytes"] == 0 for p in plans)
    assert len({p.prediction.step_time_s for p in plans}) == 1
    assert all(p.prediction.breakdown.get("h2d_s", 0.0) == 0.0 for p in plans)


def test_free_search_on_a_cpu_device_never_offloads(profile):
    result = search(profile, load_hardware("cpu"), gpus_per_node=WORLD, global_batch_size=8, top_k=8)
    assert all(candidate.shape.num_offloaded == 0 for candidate in result.candidates)


def test_offloading_does_not_make_a_cpu_device_fit(profile):
    # Below the peak without offload (the margin kept free comes on top): offloading every shard
    # would fit it on a GPU, but on a CPU device the shards stay in the same memory.
    tight = pinned(profile, 0.0).candidates[0].memory.peak_gpu_bytes
    with pytest.raises(ValueError, match="offload frees nothing on a CPU device"):
        search(
            profile,
            load_hardware("cpu"),
            gpus_per_node=WORLD,
            global_batch_size=8,
            device_memory_bytes=tight,
            fixed=dict(chunk_size=CHUNK, cache_blocks=2, prefetch=1, micro_batch_size=2, dtype="fp32", offload=1.0),
        )
