"""The search: valid plans, pinned shapes, properties of its predictions, infeasible requests.

Profiles here are analytic (costmodel.synthetic), so these tests run in seconds without tracing;
tests/unit/test_search_presets.py repeats the preset sanity checks on traced profiles.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from elixir_tune.costmodel.memory import model_state_bytes
from elixir_tune.costmodel.synthetic import example_hardware, gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.plan import MODEL_STATE_KEYS, validate
from elixir_tune.search import InfeasibleError, parse_fixed, search

GIB = 2**30


@pytest.fixture(scope="module")
def a100():
    return load_hardware("a100-40gb-pcie")


@pytest.fixture(scope="module")
def profiles():
    return {name: gpt2_profile(name) for name in ("gpt2", "gpt2-4b", "gpt2-10b", "gpt2-20b")}


def cpu_hardware():
    """A CPU node described as the device, as the probe writes it on a machine without GPUs."""
    spec = example_hardware(gpu_memory_gib=8, host_memory_gib=16, gpus_per_node=2)
    return dataclasses.replace(
        spec,
        name="cpu-test",
        device="cpu",
        device_name="cpu",
        matmul_tflops={"fp32": 0.05},
        matmul_peak_tflops={},
        hbm_gbps=10.0,
        allgather_gbps=2.0,
        reduce_scatter_gbps=2.0,
    )


def with_memory(spec, usable_gib: float):
    return dataclasses.replace(
        spec, gpu_memory_bytes=int(usable_gib * GIB) + GIB, usable_memory_bytes=int(usable_gib * GIB)
    )


def assert_covers_every_trainable_param_once(plan, profile):
    names = [name for chunk in plan.memory.chunks for name in chunk.params]
    assert sorted(names) == sorted(p.name for p in profile.params if p.requires_grad)
    assert len(names) == len(set(names))
    for chunk in plan.memory.chunks:
        assert chunk.numel <= plan.memory.chunk_size


def test_plan_is_valid_with_prediction_and_alternatives(profiles, a100):
    result = search(profiles["gpt2-4b"], a100, gpus_per_node=2, top_k=4)
    plan = result.plan
    assert validate(plan) == []
    assert plan.cluster.backend == "nccl" and plan.cluster.world_size == 2
    assert plan.training.global_batch_size == 16  # 8 per GPU by default
    assert plan.model.num_blocks == 32 and plan.model.block_list == "transformer.h"
    assert len(result.candidates) == 4 and len(plan.search.alternatives) == 3
    times = [c.step_time_s for c in result.candidates]
    assert times == sorted(times)
    assert plan.prediction.step_time_s == pytest.approx(times[0], rel=1e-5)
    assert plan.prediction.peak_gpu_bytes <= a100.usable_memory_bytes
    assert set(plan.prediction.model_state_bytes) == set(MODEL_STATE_KEYS)
    assert result.why
    assert_covers_every_trainable_param_once(plan, profiles["gpt2-4b"])


def test_prediction_model_states_follow_the_plan_formula(profiles, a100):
    plan = search(profiles["gpt2-10b"], a100, gpus_per_node=2).plan
    chunks = plan.memory.chunks
    offloaded = sum(c.offload for c in chunks)
    expected = model_state_bytes(
        plan.memory.chunk_size,
        plan.world_size,
        plan.training.dtype,
        plan.memory.cache_blocks,
        sum(c.resident for c in chunks),
        len(chunks) - offloaded,
        offloaded,
    )
    assert plan.prediction.model_state_bytes == expected


def test_step_time_covers_compute_and_breakdown_is_consistent(profiles, a100):
    result = search(profiles["gpt2-10b"], a100, gpus_per_node=1)
    for candidate in result.candidates:
        parts = candidate.estimate.breakdown
        assert candidate.step_time_s >= parts["compute_s"] + parts["optimizer_exposed_s"] - 1e-9
        assert parts["exposed_fetch_s"] >= 0 and parts["recompute_s"] <= parts["compute_s"]


def test_pinned_shape_for_engine_tests_on_cpu():
    profile = gpt2_profile("gpt2-tiny", seq_len=128, positions=128, vocab=256, dtype="fp32")
    fixed = {"offload": 0.5, "cache_blocks": "all", "prefetch": 2, "checkpointing": "all", "micro_batch_size": 2}
    result = search(profile, cpu_hardware(), gpus_per_node=2, fixed=fixed)
    plan = result.plan
    assert validate(plan) == []
    assert plan.cluster.device == "cpu" and plan.cluster.backend == "gloo"
    cacheable = sum(not c.resident for c in plan.memory.chunks)
    assert plan.memory.cache_blocks == cacheable and plan.memory.prefetch == 2
    assert plan.training.activation_checkpointing.every == 1
    assert plan.training.micro_batch_size == 2 and plan.training.grad_accum_steps == 4
    assert sum(c.offload for c in plan.memory.chunks) == int(0.5 * len(plan.memory.chunks) + 0.5)
    assert_covers_every_trainable_param_once(plan, profile)


def test_pinned_values_are_honoured_as_strings_too(profiles, a100):
    profile = profiles["gpt2-4b"]
    chunk_size = 160 * 2**20
    result = search(
        profile,
        a100,
        gpus_per_node=2,
        fixed=[f"chunk_size={chunk_size}", "cache_blocks=4", "prefetch=1", "checkpointing=every:2", "dtype=fp16"],
    )
    plan = result.plan
    assert (plan.memory.chunk_size, plan.memory.cache_blocks, plan.memory.prefetch) == (chunk_size, 4, 1)
    assert plan.training.activation_checkpointing.every == 2 and plan.training.dtype == "fp16"


@pytest.mark.parametrize(
    "bad",
    [
        {"chunk_size": 1000},
        {"nope": 1},
        {"offload": 1.5},
        {"checkpointing": "some"},
        {"micro_batch_size": 3},
        {"dtype": "int8"},
    ],
)
def test_bad_pins_are_refused_with_the_key_named(profiles, a100, bad):
    with pytest.raises(ValueError) as error:
        search(profiles["gpt2"], a100, gpus_per_node=4, fixed=bad)
    assert list(bad)[0] in str(error.value)


def test_parse_fixed_types():
    assert parse_fixed(["cache_blocks=all", "offload=0.25", "checkpointing=none", "prefetch=0"]) == {
        "cache_blocks": "all",
        "offload": 0.25,
        "checkpointing": 0,
        "prefetch": 0,
    }


@pytest.mark.parametrize("name,gpus", [("gpt2-10b", 1), ("gpt2-4b", 2)])
def test_more_gpu_memory_is_never_predicted_slower(profiles, a100, name, gpus):
    times = []
    for usable_gib in (24, 30, 36, 40, 48, 64, 80):
        try:
            times.append(
                search(profiles[name], with_memory(a100, usable_gib), gpus_per_node=gpus).candidates[0].step_time_s
            )
        except InfeasibleError:
            times.append(float("inf"))
    assert any(t < float("inf") for t in times)
    assert all(later <= earlier + 1e-12 for earlier, later in itertools.pairwise(times)), times


def test_more_gpus_never_give_more_model_state_memory_per_gpu(profiles, a100):
    profile = profiles["gpt2-10b"]
    fixed = {"chunk_size": 256 * 2**20, "cache_blocks": 4, "offload": 0.5, "checkpointing": "all"}
    host = 64 * 2**40
    per_gpu = []
    for gpus in (1, 2, 4, 8):
        plan = search(profile, with_memory(a100, 200), gpus_per_node=gpus, fixed=fixed, host_memory_bytes=host).plan
        per_gpu.append(sum(plan.prediction.model_state_bytes.values()))
    assert all(later <= earlier for earlier, later in itertools.pairwise(per_gpu)), per_gpu
    assert per_gpu[-1] < per_gpu[0]


def test_pinning_more_offload_never_lowers_host_memory(profiles, a100):
    profile = profiles["gpt2-10b"]
    hosts = []
    for share in (0.0, 0.25, 0.5, 0.75, 1.0):
        fixed = {"offload": share, "chunk_size": 256 * 2**20}
        hosts.append(
            search(profile, with_memory(a100, 200), gpus_per_node=2, fixed=fixed).plan.prediction.peak_host_bytes
        )
    assert hosts[0] == 0
    assert all(later >= earlier for earlier, later in itertools.pairwise(hosts)), hosts
    assert hosts[-1] > hosts[0]


def test_infeasible_on_the_device_says_what_the_smallest_configuration_needs(profiles, a100):
    with pytest.raises(InfeasibleError) as caught:
        search(profiles["gpt2-20b"], with_memory(a100, 4), gpus_per_node=1)
    error = caught.value
    assert error.required_gpu_bytes > error.usable_gpu_bytes == 4 * GIB
    message = str(error)
    assert "GiB" in message and "more GPUs" in message and "smaller batch" in message
    assert f"{error.required_gpu_bytes / GIB:.2f} GiB" in message


def test_infeasible_on_the_host_says_so(profiles, a100):
    with pytest.raises(InfeasibleError) as caught:
        search(profiles["gpt2-20b"], a100, gpus_per_node=1, host_memory_bytes=64 * GIB)
    error = caught.value
    assert error.required_gpu_bytes <= error.usable_gpu_bytes
    assert error.required_host_bytes > error.host_memory_bytes
    assert "host memory" in str(error)


def test_elixir_rule_gives_a_valid_plan_scored_by_the_same_model(profiles, a100):
    # gpt2-4b on 4 GPUs: on fewer, or for gpt2-10b, Elixir's rule fills a 40 GB device past the
    # margin the engine keeps free.
    profile = profiles["gpt2-4b"]
    elixir = search(profile, a100, gpus_per_node=4, strategy="elixir")
    joint = search(profile, a100, gpus_per_node=4)
    assert validate(elixir.plan) == [] and elixir.plan.search.strategy == "elixir"
    assert elixir.plan.training.grad_accum_steps == 1  # Elixir has no gradient accumulation
    assert elixir.candidates[0].memory.required_gpu_bytes <= a100.usable_memory_bytes
    assert joint.candidates[0].step_time_s <= elixir.candidates[0].step_time_s


# Sanity on presets (analytic profiles; traced ones in test_search_presets.py).


def test_gpt2_124m_on_4_a100_does_not_offload(profiles, a100):
    plan = search(profiles["gpt2"], a100, gpus_per_node=4).plan
    assert not any(chunk.offload for chunk in plan.memory.chunks)


def test_gpt2_10b_on_1_a100_offloads(profiles, a100):
    plan = search(profiles["gpt2-10b"], a100, gpus_per_node=1).plan
    assert any(chunk.offload for chunk in plan.memory.chunks)


def test_gpt2_20b_on_4_a100_fits_and_covers_every_parameter(profiles, a100):
    plan = search(profiles["gpt2-20b"], a100, gpus_per_node=4).plan
    assert validate(plan) == []
    assert plan.prediction.peak_gpu_bytes <= a100.usable_memory_bytes
    assert plan.prediction.peak_host_bytes <= a100.host_memory_bytes
    assert_covers_every_trainable_param_once(plan, profiles["gpt2-20b"])


def test_search_keeps_the_margin_free(profiles, a100):
    result = search(profiles["gpt2-10b"], a100, gpus_per_node=2)
    memory = result.candidates[0].memory
    assert memory.margin_bytes >= max(2**30, 0.05 * a100.gpu_memory_bytes)
    assert memory.peak_gpu_bytes + memory.margin_bytes <= a100.usable_memory_bytes


def test_elixir_rule_budget_is_cut_until_its_choice_fits_our_memory_model(profiles, a100):
    from elixir_tune.costmodel.model import CostModel
    from elixir_tune.search.elixir_rule import elixir_shape, fitted_elixir_shape

    model = CostModel(profiles["gpt2-10b"], a100, gpus_per_node=1)
    # The rule as Elixir wrote it budgets for its own engine and overshoots ours on a 40 GB card.
    raw = elixir_shape(model, per_rank_batch=8)
    assert model.memory(raw).required_gpu_bytes > a100.usable_memory_bytes
    shape, memory = fitted_elixir_shape(model, 8, a100.usable_memory_bytes)
    assert memory.required_gpu_bytes <= a100.usable_memory_bytes

    # Less budget: the rule puts fewer model-state bytes on the device (cache blocks + device shards).
    def on_device(states: dict) -> int:
        return states["cache_bytes"] + states["resident_bytes"] + states["device_shard_bytes"]

    assert on_device(memory.model_state_bytes) < on_device(model.memory(raw).model_state_bytes)
    assert search(profiles["gpt2-10b"], a100, gpus_per_node=1, strategy="elixir").plan.search.strategy == "elixir"
