"""Preset sanity checks on profiles traced by the profiler (meta device, seconds each)."""

from __future__ import annotations

import pytest

from elixir_tune import paths
from elixir_tune.costmodel.trace import checkpointed_trace
from elixir_tune.hardware import load_hardware
from elixir_tune.plan import validate
from elixir_tune.profiler.profile import profile_model
from elixir_tune.search import search

pytestmark = pytest.mark.slow  # traces real model configs on the meta device, seconds each


def traced(name: str, **kwargs):
    return profile_model(
        str(paths.MODEL_CONFIGS_DIR / f"{name}.yaml"),
        batch_size=8,
        seq_len=kwargs.get("seq_len", 1024),
        dtype=kwargs.get("dtype", "bf16"),
        checkpointing=kwargs.get("checkpointing", "none"),
    )


@pytest.fixture(scope="module")
def a100():
    return load_hardware("a100-40gb-pcie")


def test_synthesised_checkpointed_trace_matches_the_profiled_one():
    profile = traced("gpt2-tiny", seq_len=128, dtype="fp32", checkpointing="all")
    assert profile.trace_checkpointed
    assert [step for step, _kind in checkpointed_trace(profile, 1)] == [s for s in profile.trace_checkpointed if s]


def test_gpt2_124m_on_4_a100_chooses_no_offload(a100):
    plan = search(traced("gpt2-124m"), a100, gpus_per_node=4).plan
    assert validate(plan) == []
    assert not any(chunk.offload for chunk in plan.memory.chunks)


def test_gpt2_10b_on_1_a100_offloads(a100):
    plan = search(traced("gpt2-10b"), a100, gpus_per_node=1).plan
    assert validate(plan) == []
    assert any(chunk.offload for chunk in plan.memory.chunks)


def test_gpt2_20b_on_4_a100_fits_and_its_chunks_cover_every_parameter_once(a100):
    profile = traced("gpt2-20b")
    plan = search(profile, a100, gpus_per_node=4).plan
    assert validate(plan) == []
    assert plan.prediction.peak_gpu_bytes <= a100.usable_memory_bytes
    assert plan.prediction.peak_host_bytes <= a100.host_memory_bytes
    names = [name for chunk in plan.memory.chunks for name in chunk.params]
    assert sorted(names) == sorted(p.name for p in profile.params if p.requires_grad)
    assert len(names) == len(set(names))
    assert plan.model.fingerprint == profile.fingerprint
