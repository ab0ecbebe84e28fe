"""Expert parallelism as a search axis: which expert degrees the search tries, the pins, and the
plans it emits (they pass ``validate`` and keep to the engine's limits, plan/capabilities.py), on
the zoo's tiny Qwen3-MoE and Mixtral (hidden 32, 2 layers, 4 experts, 2 per token)."""

from __future__ import annotations

import pytest

from elixir_tune.costmodel.parallel import DATA_ONLY, Layout
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.plan import dump_plan, validate
from elixir_tune.plan.capabilities import EXPERT_PARALLEL_RUNS_WITH, is_expert_param
from elixir_tune.search import search
from elixir_tune.search.layouts import expert_degrees, layout_choices


def _profile(name: str):
    from elixir_tune.profiler import profile_model
    from elixir_tune.profiler.source import quiet_transformers
    from tests.zoo.models import SEQ, model_source

    with quiet_transformers():
        return profile_model(model_source(name), batch_size=2, seq_len=SEQ, checkpointing="all")


@pytest.fixture(scope="module")
def profiles():
    return {name: _profile(name) for name in ("qwen3_moe", "mixtral")}


@pytest.fixture(scope="module")
def h100():
    return load_hardware("h100-80gb-sxm")


def test_expert_degrees_divide_the_data_size_and_the_experts(profiles):
    moe = profiles["qwen3_moe"]  # 4 experts per block
    assert expert_degrees(moe, 8) == [2, 4]
    assert expert_degrees(moe, 6) == [2]
    assert expert_degrees(moe, 1) == []
    dense = gpt2_profile("dense", hidden=64, layers=2, heads=4, vocab=128, positions=16, seq_len=16)
    assert expert_degrees(dense, 8) == []


def test_layouts_offer_experts_beside_data_parallelism_only(profiles):
    layouts = layout_choices(profiles["qwen3_moe"], 4, 1, 16, {})
    expert = [layout for layout in layouts if layout.expert > 1]
    assert expert == [Layout(expert=2), Layout(expert=4)]  # never with pipeline stages or tensor degree
    assert any(layout.pipeline > 1 or layout.tensor > 1 for layout in layouts)
    assert layout_choices(profiles["qwen3_moe"], 4, 1, 16, {"expert": 4}) == [Layout(expert=4)]


@pytest.mark.parametrize(
    "fixed,why",
    [
        ({"expert": 3}, "it does not divide the model's 4 experts per block"),
        ({"expert": 4, "pipeline": 2}, "the engine does not run expert parallelism beside pipeline stages"),
        ({"expert": 2, "accumulation": "layered"}, "the engine does not run expert parallelism beside .*layered"),
    ],
)
def test_a_pin_the_engine_cannot_run_says_why(profiles, fixed, why):
    with pytest.raises(ValueError, match=why):
        layout_choices(profiles["qwen3_moe"], 4, 1, 16, fixed)


def test_free_search_tries_expert_layouts(profiles, h100):
    result = search(profiles["mixtral"], h100, gpus_per_node=4, global_batch_size=16)
    assert {DATA_ONLY, Layout(expert=2), Layout(expert=4)} <= set(result.models)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("loop", ["plain", "forward_backward"])
def test_expert_plans_validate_and_keep_to_the_engine(profiles, h100, name, loop):
    profile = profiles[name]
    # Offload all it may: the expert chunks go to the host only where the engine's limits table allows it.
    result = search(profile, h100, gpus_per_node=4, global_batch_size=16, fixed=["expert=2", "offload=1"], loop=loop)
    plan = result.plan
    assert plan.parallel.expert.degree == 2 and plan.data_parallel_size == 4
    assert validate(plan) == []
    assert "ep2" in result.candidates[0].layout.describe()
    assert plan.training.accumulation == "standard"  # layered is not run beside expert parallelism
    expert_chunks = [c for c in plan.memory.chunks if any(is_expert_param(p) for p in c.params)]
    assert expert_chunks and all(all(is_expert_param(p) for p in c.params) for c in expert_chunks)
    offloadable = EXPERT_PARALLEL_RUNS_WITH["offloaded_experts"]
    assert all(c.offload == offloadable for c in expert_chunks)
    assert all(c.offload for c in plan.memory.chunks if c not in expert_chunks)  # the others went to the host
    # The chunks hold each rank's experts: half of every expert tensor.
    sizes = {p.name: p.numel for p in profile.params}
    held = sum(sizes[name] for c in expert_chunks for name in c.params)
    assert all(c.numel <= plan.memory.chunk_size for c in expert_chunks)
    assert held // 2 <= sum(c.numel for c in expert_chunks) < held
    assert plan.prediction is not None and plan.prediction.breakdown["expert_comm_s"] > 0
    assert "expert:\n    degree: 2" in dump_plan(plan)
