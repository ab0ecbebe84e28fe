"""The plan's ``engine`` section: our own engine's plans read as before, peer settings are checked."""

from __future__ import annotations

import copy

import pytest
import yaml

from elixir_tune.paths import CONFIGS_DIR
from elixir_tune.plan import EngineChoice, dump_plan, plan_from_dict
from elixir_tune.plan.validate import validate_dict


@pytest.fixture
def raw() -> dict:
    return yaml.safe_load((CONFIGS_DIR / "plans" / "example.yaml").read_text())


def _with_engine(raw: dict, **engine) -> dict:
    changed = copy.deepcopy(raw)
    changed["engine"] = engine
    for chunk in changed["memory"]["chunks"]:
        chunk["offload"] = chunk["resident"] = False
    return changed


def test_own_engine_plans_have_no_engine_section(raw: dict):
    plan = plan_from_dict(raw)
    assert plan.engine == EngineChoice()
    assert "engine:" not in dump_plan(plan)


@pytest.mark.parametrize(
    "engine",
    [
        {"name": "fsdp2"},
        {"name": "fsdp2", "offload_params": True, "offload_optimizer": True, "offload_units": 2},
        {"name": "fsdp2", "reshard_after_forward": False},
        {"name": "deepspeed", "zero_stage": 2, "offload_optimizer": True},
        {"name": "deepspeed", "offload_params": True, "offload_optimizer": True, "max_live_elements": 1000},
    ],
)
def test_peer_plans_validate_and_round_trip(raw: dict, engine: dict):
    changed = _with_engine(raw, **engine)
    assert validate_dict(changed) == []
    plan = plan_from_dict(changed)
    again = yaml.safe_load(dump_plan(plan))
    assert again["engine"] == {key: value for key, value in engine.items()}
    assert plan_from_dict(again) == plan


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        ({"name": "elixir", "zero_stage": 2}, "engine.zero_stage: is a setting of fsdp2 or deepspeed"),
        ({"name": "fsdp2", "zero_stage": 2}, "engine.zero_stage: is not a setting of engine fsdp2"),
        ({"name": "deepspeed", "offload_units": 1}, "engine.offload_units: is not a setting of engine deepspeed"),
        ({"name": "fsdp2", "offload_params": True}, "engine.offload_optimizer: FSDP2's CPUOffloadPolicy"),
        ({"name": "deepspeed", "zero_stage": 2, "offload_params": True}, "at zero_stage 3 only"),
        ({"name": "megatron"}, "engine.name: unknown value 'megatron'"),
    ],
)
def test_peer_settings_that_cannot_run_are_refused(raw: dict, engine: dict, expected: str):
    problems = validate_dict(_with_engine(raw, **engine))
    assert any(expected in problem for problem in problems), problems


def test_peer_engines_refuse_chunk_engine_choices(raw: dict):
    changed = _with_engine(raw, name="fsdp2")
    changed["memory"]["chunks"][0]["offload"] = True
    problems = validate_dict(changed)
    assert any("per-chunk offload choices are the chunk engine's" in problem for problem in problems), problems
