"""The search across engines (--engine, --fix engine=): our engine by default, the peers on request."""

from __future__ import annotations

import pytest

from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.plan import dump_plan, validate
from elixir_tune.search import search


@pytest.fixture(scope="module")
def profile():
    return gpt2_profile("g", hidden=256, layers=4, heads=4, vocab=256, positions=128, seq_len=128, dtype="fp32")


def run(profile, **kwargs):
    return search(profile, load_hardware("a100-40gb-pcie"), gpus_per_node=4, global_batch_size=16, **kwargs)


def test_the_default_search_is_our_engine_alone(profile):
    result = run(profile)
    assert result.plan.engine.name == "elixir"
    assert "engine:" not in dump_plan(result.plan)
    assert all("engine" not in row for row in result.plan.search.alternatives)


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_a_peer_engine_search_writes_a_plan_that_validates(profile, engine):
    result = run(profile, engine=engine)
    assert result.plan.engine.name == engine
    assert validate(result.plan) == []
    assert not any(chunk.offload or chunk.resident for chunk in result.plan.memory.chunks)
    assert result.plan.prediction.step_time_s == pytest.approx(result.candidates[0].step_time_s, abs=1e-6)


def test_any_ranks_every_engine_together_and_says_why(profile):
    result = run(profile, engine="any")
    times = [c.step_time_s for c in result.candidates]
    assert times == sorted(times)
    assert validate(result.plan) == []
    for name in ("elixir", "fsdp2", "deepspeed"):
        assert name in result.why
    engines = {row.get("engine", "elixir").split()[0] for row in result.plan.search.alternatives}
    assert engines | {result.plan.engine.name} == {"elixir", "fsdp2", "deepspeed"}


def test_a_fix_engine_pin_narrows_the_search(profile):
    assert run(profile, fixed=["engine=deepspeed"], engine="any").plan.engine.name == "deepspeed"
    with pytest.raises(ValueError, match="disagree"):
        run(profile, fixed=["engine=deepspeed"], engine="fsdp2")


def test_chunk_engine_pins_are_refused_for_a_peer_alone(profile):
    with pytest.raises(ValueError, match="--fix cache_blocks: a setting of our chunk engine"):
        run(profile, engine="fsdp2", fixed=["cache_blocks=2"])
