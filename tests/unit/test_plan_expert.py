"""Expert parallelism in the plan: ``parallel.expert.degree``, its validation, and the expert numbers
the profiler reads from a model's config (``model.num_experts``: only when the config ships an expert
plan that dispatches tokens)."""

from __future__ import annotations

import pytest

from elixir_tune.paths import CONFIGS_DIR
from elixir_tune.plan import ExpertParallel, plan_from_dict, read_plan_dict, validate_dict
from elixir_tune.plan.capabilities import EXPERT_PARALLEL_RUNS_WITH
from elixir_tune.plan.io import dump_plan

EXAMPLE = CONFIGS_DIR / "plans" / "example.yaml"  # tiny GPT-2, world 2, 2 blocks


def _expert_plan(degree: int = 2, num_experts: int = 4, **extra) -> dict:
    raw = read_plan_dict(EXAMPLE)
    raw.setdefault("parallel", {})["expert"] = {"degree": degree}
    raw["model"]["num_experts"] = num_experts
    for path, value in extra.items():
        section, key = path.split("__")
        raw.setdefault(section, {})[key] = value
    return raw


def test_expert_degree_validates_and_round_trips():
    raw = _expert_plan()
    assert validate_dict(raw) == []
    plan = plan_from_dict(raw)
    assert plan.parallel.expert == ExpertParallel(degree=2)
    assert plan.model.num_experts == 4
    assert plan.data_parallel_size == 2  # expert parallelism adds no ranks: it lives inside the data group
    text = dump_plan(plan)
    assert "expert:" in text and "num_experts: 4" in text
    import yaml

    assert plan_from_dict(yaml.safe_load(text)) == plan


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            _expert_plan(num_experts=0),
            "parallel.expert.degree: 2, but the model ships no expert plan (model.num_experts is 0: its config has "
            "no base_model_ep_plan dispatching tokens to experts); set it to 1",
        ),
        (
            _expert_plan(num_experts=3),
            "parallel.expert.degree: 2 does not divide the model's 3 experts per block; pick a degree that divides them",
        ),
        (
            _expert_plan(degree=4, num_experts=8),
            "parallel.expert.degree: 4 does not divide the data-parallel size 2; the experts are spread over groups "
            "of data ranks, pick a degree that divides it",
        ),
    ],
)
def test_bad_expert_degrees_say_what_to_do(raw, expected):
    assert validate_dict(raw) == [expected]


def test_expert_parallelism_is_not_combined_with_tensor_parallelism_yet():
    raw = _expert_plan()
    raw["parallel"]["tensor"] = {"degree": 2}
    raw["cluster"]["gpus_per_node"] = 4  # world 4 = data 2 x tensor 2
    problems = validate_dict(raw)
    assert any("with tensor degree 2: the engine does not run expert parallelism beside" in p for p in problems), (
        problems
    )


def test_expert_limits_come_from_one_table(monkeypatch):
    """validate reads capabilities.EXPERT_PARALLEL_RUNS_WITH: a limit lifted there is lifted here."""
    from elixir_tune.plan import capabilities

    raw = _expert_plan()
    raw["training"]["accumulation"] = "layered"
    raw["training"]["loop"] = "forward_backward"
    assert any("layered accumulation" in p for p in validate_dict(raw))
    monkeypatch.setitem(capabilities.EXPERT_PARALLEL_RUNS_WITH, "layered", True)
    assert not any("layered accumulation" in p for p in validate_dict(raw))


def test_offloaded_expert_chunks_are_refused_where_the_engine_keeps_them(monkeypatch):
    monkeypatch.setitem(EXPERT_PARALLEL_RUNS_WITH, "offloaded_experts", False)
    raw = _expert_plan()
    chunk = raw["memory"]["chunks"][-1]  # as if it held the experts of a mixture-of-experts block
    chunk["params"] = ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]
    chunk["offload"] = False
    assert not any("offloaded expert" in p for p in validate_dict(raw))
    chunk["offload"] = True
    problems = validate_dict(raw)
    assert any("1 offloaded expert chunks" in p for p in problems), problems
    monkeypatch.setitem(EXPERT_PARALLEL_RUNS_WITH, "offloaded_experts", True)  # as the engine runs today
    assert not any("offloaded expert" in p for p in validate_dict(raw))


def test_expert_degree_zero_is_a_schema_error():
    problems = validate_dict(_expert_plan(degree=0))
    assert problems and problems[0].startswith("parallel.expert.degree"), problems


@pytest.mark.parametrize(
    ("family", "experts", "top_k"),
    [("qwen3_moe", 4, 2), ("mixtral", 4, 2), ("llama", 0, 0), ("qwen3", 0, 0)],
)
def test_profiler_records_experts_only_for_families_with_an_expert_plan(family, experts, top_k):
    from elixir_tune.profiler.arch import model_arch
    from elixir_tune.profiler.source import quiet_transformers
    from tests.unit.models import stage_families

    with quiet_transformers():
        model = stage_families.build(family, meta=True)
    arch = model_arch(model)
    assert (arch.num_experts, arch.experts_per_token) == (experts, top_k)


def test_a_chunk_mixing_experts_and_other_parameters_is_refused():
    raw = _expert_plan()
    chunk = raw["memory"]["chunks"][-1]
    chunk["params"] = ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.down_proj"]
    problems = validate_dict(raw)
    assert any("expert tensors beside other parameters" in p for p in problems), problems
