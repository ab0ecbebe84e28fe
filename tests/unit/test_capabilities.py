"""The plan as a contract (plan/capabilities.py): the layouts the engine runs for a model and the
training loop a plan needs, as the profiler records them, the search honours them and ``validate``
enforces them; and the data slice a script takes (elixir_tune.data_rank / data_size)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

import elixir_tune
from elixir_tune.hardware import load_hardware
from elixir_tune.plan import PipelineParallel, load_plan, save_plan, validate, validate_dict
from elixir_tune.plan.capabilities import PIPELINE_MODEL_TYPES, plan_loop, unsupported_layouts
from elixir_tune.plan.tensor_layout import local_shape, supported_model_types
from elixir_tune.profiler import profile_model
from elixir_tune.search import search

MODELS = Path(__file__).parent / "models"
# Tiny transformers configs of families with and without adapters: (architecture, config fields).
FAMILIES = {
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 128, "n_positions": 32},
    "qwen2": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
              "intermediate_size": 64, "vocab_size": 128},
    "qwen3": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
              "intermediate_size": 64, "vocab_size": 128, "head_dim": 16},
    "gpt_neox": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
                 "vocab_size": 128},
    "opt": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "ffn_dim": 64, "vocab_size": 128,
            "word_embed_proj_dim": 32},
    "falcon": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 128},
}  # fmt: skip


def _profile(tmp_path: Path, family: str):
    import yaml

    path = tmp_path / f"{family}.yaml"
    path.write_text(yaml.safe_dump({"name": f"{family}-tiny", "architecture": family, "config": FAMILIES[family]}))
    return profile_model(str(path), batch_size=2, seq_len=16)


@pytest.fixture(scope="module")
def profiles(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("families")
    found = {family: _profile(tmp, family) for family in FAMILIES}
    found["t5"] = profile_model(f"{MODELS}/families.py:build_t5", batch_size=2, seq_len=8)
    found["mlp"] = profile_model(f"{MODELS}/tiny_mlp.py", batch_size=2, seq_len=8)
    return found


def test_the_lists_are_the_engines():
    from elixir_tune.engine.parallel.tp_adapters import FAMILY_PLANS

    assert set(supported_model_types()) == set(FAMILY_PLANS)


def test_the_pipeline_families_are_those_whose_stage_plan_the_engine_accepts():
    """The torch-free fallback list equals the families of stage_families.py whose tiny causal LM
    stage_plans.py accepts (the profile's record and the engine's check); the others are refused
    with the reason. Our own tables cover only families that ship no plan."""
    from elixir_tune.models.stage_plans import HAND_PLANS, pipeline_problem, resolve_stage_plan
    from elixir_tune.profiler.source import quiet_transformers
    from tests.unit.models import stage_families

    accepted, sources = set(), {}
    for family in stage_families.FAMILIES:
        with quiet_transformers():
            model = stage_families.build(family, meta=True)
        problem = pipeline_problem(model)
        if problem is None:
            accepted.add(family)
            sources[family] = resolve_stage_plan(model).source  # type: ignore[union-attr]
        else:
            assert problem.startswith(f"model type {family!r} has no pipeline plan"), problem
    assert accepted == set(PIPELINE_MODEL_TYPES)
    assert {f for f, source in sources.items() if source == "elixir-tune table"} == set(HAND_PLANS) == {"gpt2", "opt"}
    with quiet_transformers():
        moe = stage_families.build("mixtral", meta=True)
    moe.config.output_router_logits = True
    assert "auxiliary loss (config.output_router_logits)" in str(pipeline_problem(moe))


def test_reasons_name_the_model_and_what_runs():
    assert unsupported_layouts("llama", is_causal_lm=True, tensor_problem="") == {}  # its table was made
    assert unsupported_layouts("gpt2", is_causal_lm=True) == {}  # a built-in table
    # Without the model at hand, a family without a built-in table is not taken to split.
    assert "no tensor table is recorded" in unsupported_layouts("llama", is_causal_lm=True)["tensor"]
    assert set(unsupported_layouts("opt", is_causal_lm=True)) == {"tensor"}
    assert unsupported_layouts("mixtral", True, "uses moe styles") == {"tensor": "uses moe styles"}  # stages run it
    reasons = unsupported_layouts("t5", is_causal_lm=False)
    assert "model type 't5' has no pipeline plan known to run" in reasons["pipeline"]
    assert "model type 't5': no tensor table is recorded" in reasons["tensor"]
    assert "causal LMs (with an lm_head) only" in unsupported_layouts("gpt2", is_causal_lm=False)["pipeline"]
    assert "without a transformers config" in unsupported_layouts("", is_causal_lm=False)["tensor"]
    # What the profiler found on the model wins over the family list.
    assert "pipeline" not in unsupported_layouts("glm4", is_causal_lm=True, pipeline_problem=None)
    assert unsupported_layouts("llama", is_causal_lm=True, pipeline_problem="why")["pipeline"] == "why"


def test_the_profile_records_what_the_engine_runs(profiles):
    assert profiles["gpt2"].unsupported_layouts == {}
    assert profiles["qwen2"].unsupported_layouts == {}
    assert set(profiles["opt"].unsupported_layouts) == {"tensor"}
    assert "ships no tensor plan" in profiles["opt"].unsupported_layouts["tensor"]
    for family in ("qwen3", "gpt_neox"):  # both layouts from their transformers plans
        assert profiles[family].unsupported_layouts == {}, family
        assert profiles[family].arch.tensor_layout, family
    for family in ("falcon", "t5", "mlp"):
        assert "has no pipeline plan" in profiles[family].layout_reasons()["pipeline"], family


@pytest.mark.parametrize("family", [*FAMILIES, "t5", "mlp"])
def test_the_default_search_emits_a_plain_loop_plan(profiles, family):
    result = search(profiles[family], load_hardware("cpu"), gpus_per_node=2, global_batch_size=8)
    plan = result.plan
    assert plan.parallel.is_default() and plan.training.accumulation == "standard"
    assert plan.training.loop == "plain" and validate(plan) == []
    assert plan.model.unsupported_layouts == profiles[family].layout_reasons()


@pytest.mark.parametrize("family", [*FAMILIES, "t5", "mlp"])
@pytest.mark.parametrize("gpus", [2, 4])
def test_forward_backward_plans_use_only_layouts_the_model_runs(profiles, family, gpus):
    profile = profiles[family]
    plan = search(profile, load_hardware("h100-80gb-sxm"), gpus_per_node=gpus, loop="forward_backward").plan
    reasons = profile.layout_reasons()
    assert plan.training.loop == "forward_backward" and validate(plan) == []
    assert plan.parallel.pipeline.stages == 1 or "pipeline" not in reasons
    assert plan.parallel.tensor.degree == 1 or "tensor" not in reasons


@pytest.mark.parametrize(
    ("family", "pin", "why"),
    [("falcon", "pipeline=2", "has no pipeline plan"), ("opt", "tensor=2", "ships no tensor plan")],
)
def test_a_pinned_layout_the_model_cannot_run_is_refused_with_the_reason(profiles, family, pin, why):
    hardware = load_hardware("cpu")
    with pytest.raises(ValueError, match=f"--fix {pin}: not possible for {family}-tiny: model type '{family}' {why}"):
        search(profiles[family], hardware, gpus_per_node=2, global_batch_size=8, fixed=[pin], loop="forward_backward")


@pytest.mark.parametrize("pin", ["pipeline=2", "tensor=2", "accumulation=layered"])
def test_the_plain_loop_refuses_pins_that_need_forward_backward(profiles, pin):
    with pytest.raises(
        ValueError, match=f"--fix {pin}: needs a training script that runs loss = model.forward_backward"
    ):
        search(profiles["gpt2"], load_hardware("cpu"), gpus_per_node=2, global_batch_size=8, fixed=[pin])
    with pytest.raises(ValueError, match="unknown loop 'manual'"):
        search(profiles["gpt2"], load_hardware("cpu"), gpus_per_node=2, loop="manual")


def _pipeline_plan(profiles, tmp_path):
    plan = search(
        profiles["gpt2"], load_hardware("cpu"), gpus_per_node=2, global_batch_size=8, fixed=["pipeline=2"],
        loop="forward_backward",
    ).plan  # fmt: skip
    assert plan.parallel.pipeline.stages == 2
    return plan


def test_validate_refuses_a_plain_loop_with_a_layout_that_needs_forward_backward(profiles, tmp_path):
    raw = _pipeline_plan(profiles, tmp_path).to_dict()
    raw["training"]["loop"] = "plain"
    problems = validate_dict(raw)
    assert len(problems) == 1 and problems[0].startswith("training.loop: plain (model(**batch) and optimizer"), problems
    assert "pipeline stages 2" in problems[0] and "--loop forward_backward" in problems[0]
    del raw["training"]["loop"]  # a plan written before the loop was recorded: its layout's loop
    assert validate_dict(raw) == []
    plan = load_plan(_saved(raw, tmp_path))
    assert plan.training.loop is None and plan_loop(plan) == "forward_backward"


def test_validate_refuses_a_layout_the_model_cannot_run(profiles, tmp_path):
    raw = _pipeline_plan(profiles, tmp_path).to_dict()
    raw["model"]["unsupported_layouts"] = {"pipeline": "no adapter here"}
    assert validate_dict(raw) == [
        "parallel.pipeline.stages: 2, but the engine cannot run pipeline parallelism for this model: no adapter "
        "here; set it to 1 (search again without --fix pipeline=2)"
    ]
    raw["model"]["unsupported_layouts"] = {}  # the profile's record: nothing it cannot run
    assert validate_dict(raw) == []
    del raw["model"]["unsupported_layouts"]
    raw["model"]["model_type"] = "falcon"  # an older plan without the record: its family decides
    assert "model type 'falcon' has no pipeline plan known to run" in " ".join(validate_dict(raw))


def _saved(raw: dict, tmp_path: Path) -> Path:
    import yaml

    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_data_rank_and_size_follow_the_plan(profiles, tmp_path, monkeypatch):
    from elixir_tune import ranks

    monkeypatch.setattr(ranks, "_active", None)
    monkeypatch.delenv("ELIXIR_TUNE_PLAN", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert (elixir_tune.data_rank(), elixir_tune.data_size()) == (0, 1)

    plan = search(
        profiles["gpt2"], load_hardware("cpu"), gpus_per_node=4, global_batch_size=8, fixed=["pipeline=2"],
        loop="forward_backward",
    ).plan  # fmt: skip
    save_plan(plan, tmp_path / "pp.yaml")
    monkeypatch.setenv("ELIXIR_TUNE_PLAN", str(tmp_path / "pp.yaml"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    seen = []
    for rank in range(4):  # rank = (data x P + stage) x T + tensor: ranks 0, 1 are data 0; 2, 3 data 1
        monkeypatch.setenv("RANK", str(rank))
        seen.append((elixir_tune.data_rank(), elixir_tune.data_size()))
    assert seen == [(0, 2), (0, 2), (1, 2), (1, 2)]

    data_only = dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel, pipeline=PipelineParallel()))
    ranks.use_plan(data_only, 3)  # what setup records wins over the environment
    assert (elixir_tune.data_rank(), elixir_tune.data_size()) == (3, 4)


def test_a_mixture_of_experts_profile_offers_tensor_parallelism(tmp_path):
    """Qwen3-MoE's plan splits the fused experts: the profile records the table, the search's chunks
    hold each rank's slice of every expert, and validate accepts the plan."""
    import yaml

    config = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 64, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
              "head_dim": 8, "vocab_size": 128}  # fmt: skip
    path = tmp_path / "qwen3_moe.yaml"
    path.write_text(yaml.safe_dump({"name": "qwen3-moe-tiny", "architecture": "qwen3_moe", "config": config}))
    profile = profile_model(str(path), batch_size=2, seq_len=16)
    assert profile.unsupported_layouts == {}
    assert profile.arch.tensor_layout["model.layers.*.mlp.experts"] == "experts"
    plan = search(
        profile, load_hardware("cpu"), gpus_per_node=2, global_batch_size=8, fixed=["tensor=2"], loop="forward_backward"
    ).plan
    assert plan.parallel.tensor.degree == 2 and validate(plan) == []
    # The chunks hold each rank's pieces: the experts' gate | up [4, 64, 32] and down [4, 32, 32] halved.
    shapes = {p.name: list(p.shape) for p in profile.params}
    local = {name: local_shape(name, shapes[name], "qwen3_moe", 2, table=plan.model.tensor_layout) for name in shapes}
    assert local["model.layers.0.mlp.experts.gate_up_proj"] == [4, 32, 32]
    assert local["model.layers.0.mlp.experts.down_proj"] == [4, 32, 16]
    assert sum(chunk.numel for chunk in plan.memory.chunks) == sum(math.prod(shape) for shape in local.values())
