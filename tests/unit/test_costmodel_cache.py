"""The chunk cache simulation: furthest-next-use eviction is optimal, checked by brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from elixir_tune.costmodel.cache import belady, simulate_cache


def brute_force_misses(steps: list[tuple[int, ...]], cache_blocks: int) -> int:
    """Fewest fetches any eviction policy can do: dynamic programming over every cache content."""
    states = {frozenset(): 0}
    for step in steps:
        needed = frozenset(step)
        following: dict[frozenset, int] = {}
        for cached, cost in states.items():
            misses = len(needed - cached)
            others = list(cached - needed)
            room = cache_blocks - len(needed)
            for keep in range(min(room, len(others)) + 1):
                for kept in itertools.combinations(others, keep):
                    state = needed | frozenset(kept)
                    if following.get(state, 1 << 30) > cost + misses:
                        following[state] = cost + misses
        states = following
    return min(states.values())


def random_trace(rng: random.Random, num_chunks: int, length: int, max_per_step: int) -> list[tuple[int, ...]]:
    return [tuple(sorted(rng.sample(range(num_chunks), rng.randint(1, max_per_step)))) for _ in range(length)]


@pytest.mark.parametrize("seed", range(40))
def test_belady_matches_brute_force_optimum(seed: int):
    rng = random.Random(seed)
    max_per_step = 1 if seed % 2 else 2
    steps = random_trace(rng, num_chunks=rng.randint(3, 6), length=rng.randint(6, 14), max_per_step=max_per_step)
    cache_blocks = rng.randint(max_per_step, 4)
    fetches, _ = belady(steps, cache_blocks)
    assert len(fetches) == brute_force_misses(steps, cache_blocks), (steps, cache_blocks)


def test_belady_evicts_furthest_next_use_and_reports_the_freed_step():
    steps = [(0,), (1,), (2,), (0,), (1,), (2,)]
    fetches, _ = belady(steps, 2)
    # At step 2, chunk 0 is used again at step 3 and chunk 1 at step 4: 1 goes (last used at step 1).
    assert fetches[2] == (2, 2, 1)
    # Step 4 needs 1 again; 0 is never used again while 2 is at step 5: 0 goes (last used at step 3).
    assert fetches[3] == (4, 1, 3)
    assert len(fetches) == 4


def test_cache_never_holds_more_than_its_blocks():
    rng = random.Random(7)
    steps = random_trace(rng, 12, 200, 3)
    fetches, cached = belady(steps, 4)
    assert len(cached) <= 4
    assert len(fetches) >= 12


def test_cache_of_every_chunk_fetches_each_once_then_nothing():
    steps = [(0,), (1, 2), (3,), (3,), (1, 2), (0,)]
    sim = simulate_cache(steps, cache_blocks=4, num_cacheable=4)
    assert sorted(chunk for _, chunk, _ in sim.cold) == [0, 1, 2, 3]
    assert sim.steady == []


def test_steady_state_is_warm():
    # Forward 0 1 2, backward 2 1 0 with 2 blocks: the next micro-batch starts with 0 (and 1) cached.
    steps = [(0,), (1,), (2,), (2,), (1,), (0,)]
    sim = simulate_cache(steps, cache_blocks=2, num_cacheable=3)
    assert len(sim.cold) == 4
    assert len(sim.steady) < len(sim.cold)
    assert all(free < step for step, _chunk, free in sim.steady)


def test_step_needing_more_chunks_than_blocks_is_refused():
    with pytest.raises(ValueError):
        belady([(0, 1, 2)], 2)


def test_the_minimum_cache_holds_a_module_with_its_enclosing_modules_and_its_reads():
    # A parent that owns a parameter keeps its chunk gathered while its children run; a module that
    # reads another's parameter holds that chunk too (engine/module_map.py check_cache_fits).
    import dataclasses

    from elixir_tune.costmodel.layout import max_module_chunks, pack_chunks
    from elixir_tune.plan.schema import ForeignRead
    from elixir_tune.profiler.schema import ActivationLine, ModelProfile, ParamInfo

    names = ["mixer.A", "mixer.conv.weight", "mixer.proj.weight", "head.weight"]
    params = [ParamInfo(name=name, shape=[8], dtype="fp32", numel=8) for name in names]
    profile = ModelProfile(
        name="m", source="m.py", fingerprint="f", num_params=32, dtype="fp32", batch_size=1, seq_len=1,
        params=params, trace=[[0], [1], [2], [3]], flops_per_sample=1.0, activation=ActivationLine(0, 0),
    )  # fmt: skip
    layout = pack_chunks(profile, 8)  # one parameter per chunk
    assert max_module_chunks(profile, layout) == 2  # mixer.conv (or mixer.proj) with mixer's own A
    reading = dataclasses.replace(profile, foreign_reads=[ForeignRead("mixer", ["mixer.conv.weight"])])
    assert max_module_chunks(reading, layout) == 3  # mixer.proj runs while mixer holds A and conv
