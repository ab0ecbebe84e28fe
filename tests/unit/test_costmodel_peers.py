"""The peer engines' pricing (costmodel/peers.py): what each setting adds or saves, against its own rules."""

from __future__ import annotations

import dataclasses

import pytest

from elixir_tune.costmodel.model import CostModel
from elixir_tune.costmodel.peers import DS_PERSISTENCE_THRESHOLD, PeerModel, PeerShape
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.plan.engine_choice import EngineChoice


@pytest.fixture(scope="module")
def small() -> PeerModel:
    profile = gpt2_profile("g", hidden=256, layers=4, heads=4, vocab=256, positions=128, seq_len=128, dtype="bf16")
    return PeerModel(CostModel(profile, load_hardware("a100-40gb-pcie"), 4))


@pytest.fixture(scope="module")
def large() -> PeerModel:
    # ~1.3B parameters: past DeepSpeed's reuse distance (1e9 / 2), so ZeRO-3 releases what it gathered
    profile = gpt2_profile(
        "g", hidden=2048, layers=24, heads=16, vocab=50257, positions=1024, seq_len=512, dtype="bf16"
    )
    return PeerModel(CostModel(profile, load_hardware("a100-40gb-pcie"), 4))


def shape(**engine) -> PeerShape:
    return PeerShape(EngineChoice(**engine), micro_batch_size=2, grad_accum_steps=1, every=1)


def test_fsdp2_resharding_gathers_every_unit_but_the_root_again_in_backward(small: PeerModel):
    resharded = small.step_time(shape(name="fsdp2")).breakdown["allgather_s"]
    kept = small.step_time(shape(name="fsdp2", reshard_after_forward=False)).breakdown["allgather_s"]
    root = small._collective_s(small.units[0], 2, gather=True)
    assert resharded == pytest.approx(2 * kept - root)
    # and holds the root and two gathered blocks (current, prefetched) instead of every unit
    held = small.memory(shape(name="fsdp2")).model_state_bytes["cache_bytes"]
    assert held == (small.units[0] + sum(sorted(small.units[1:])[-2:])) * 2 < small.total_numel * 2


def test_fsdp2_gathers_and_reduces_once_per_micro_batch(small: PeerModel):
    one = small.step_time(PeerShape(EngineChoice("fsdp2"), 2, 1, 1)).breakdown
    four = small.step_time(PeerShape(EngineChoice("fsdp2"), 2, 4, 1)).breakdown
    assert four["allgather_s"] == pytest.approx(4 * one["allgather_s"])
    assert four["reduce_scatter_s"] == pytest.approx(4 * one["reduce_scatter_s"])


def test_zero_stages_shard_more_device_memory_each_once_parameters_are_released(large: PeerModel):
    peaks = [large.memory(shape(name="deepspeed", zero_stage=stage)).peak_gpu_bytes for stage in (1, 2, 3)]
    assert peaks[0] > peaks[1] > peaks[2]


def test_zero3_keeps_a_small_model_gathered_from_forward_to_backward(small: PeerModel):
    memory = small.memory(shape(name="deepspeed", zero_stage=3))
    sharded = small.total_numel - sum(n for n in small.param_numels if n < DS_PERSISTENCE_THRESHOLD)
    assert memory.model_state_bytes["cache_bytes"] == sharded * 2
    once = small.step_time(shape(name="deepspeed", zero_stage=3)).breakdown["allgather_s"]
    released = small.step_time(shape(name="deepspeed", zero_stage=3, max_live_elements=1000)).breakdown["allgather_s"]
    assert released == pytest.approx(2 * once)  # past the live limit: gathered again in backward


def test_offloading_the_optimizer_moves_adam_to_the_host_rate(small: PeerModel):
    plain = small.step_time(shape(name="deepspeed", zero_stage=3))
    offloaded = small.step_time(shape(name="deepspeed", zero_stage=3, offload_optimizer=True))
    shard = small.total_numel / small.world
    assert offloaded.breakdown["gpu_adam_s"] == 0.0
    assert offloaded.breakdown["cpu_adam_s"] == pytest.approx(shard / small.model.cpu_adam_elems_per_s)
    assert offloaded.step_time_s > plain.step_time_s
    device = small.memory(shape(name="deepspeed", zero_stage=3)).peak_gpu_bytes
    assert small.memory(shape(name="deepspeed", zero_stage=3, offload_optimizer=True)).peak_gpu_bytes < device


def test_fsdp2_offload_of_the_first_units_only_steps_their_share_on_the_host(small: PeerModel):
    full = small.step_time(shape(name="fsdp2", offload_params=True, offload_optimizer=True)).breakdown
    half = small.step_time(shape(name="fsdp2", offload_params=True, offload_optimizer=True, offload_units=2)).breakdown
    assert half["cpu_adam_s"] == pytest.approx(sum(small.units[:2]) / small.world / small.model.cpu_adam_elems_per_s)
    assert 0 < half["cpu_adam_s"] < full["cpu_adam_s"]
    assert full["gpu_adam_s"] == 0.0 < half["gpu_adam_s"]


def test_fsdp2_and_zero3_pay_the_compute_loss_of_their_overlapped_collectives():
    profile = gpt2_profile("g", hidden=256, layers=4, heads=4, vocab=256, positions=128, seq_len=128, dtype="bf16")
    nvlink = load_hardware("a100-80gb-sxm")
    assert nvlink.collective_compute_loss > 0
    for engine in ({"name": "fsdp2"}, {"name": "deepspeed", "zero_stage": 3}):
        lossy = PeerModel(CostModel(profile, nvlink, 4)).step_time(shape(**engine))
        free = PeerModel(CostModel(profile, dataclasses.replace(nvlink, collective_compute_loss=0.0), 4))
        base = free.step_time(shape(**engine))
        lost_s = lossy.breakdown["collective_compute_loss_s"]
        assert lost_s > 0
        assert lossy.step_time_s == pytest.approx(base.step_time_s + lost_s)


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_a_peer_plan_of_a_model_packed_in_one_chunk_is_valid(engine):
    """Issue 48: a model small enough for one chunk got a peer plan of cache 1 and prefetch 1, which the
    search then called invalid ('memory.prefetch: 1 must be smaller than memory.cache_blocks 1')."""
    from elixir_tune.paths import REPO_DIR
    from elixir_tune.plan import validate
    from elixir_tune.profiler import load_model_source, profile_model
    from elixir_tune.search import search

    # The drop-in tests' tiny Llama (no tied weights): the peers' plan packs it into one chunk.
    tiny = profile_model(load_model_source(str(REPO_DIR / "tests" / "dropin" / "tiny_llama_model.py")), 4, 32)
    fixed = {"engine": engine, "dtype": "fp32", "micro_batch_size": 4}
    plan = search(tiny, load_hardware("cpu"), gpus_per_node=2, global_batch_size=16, fixed=fixed).plan
    assert plan.engine.name == engine and len(plan.memory.chunks) == 1 and validate(plan) == []
