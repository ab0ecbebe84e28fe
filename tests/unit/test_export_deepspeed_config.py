"""The DeepSpeed configuration a plan maps to (export/deepspeed_config.py), and what it lists as not expressed."""

from __future__ import annotations

import copy

import yaml

from elixir_tune.export.deepspeed_config import deepspeed_config, deepspeed_unexpressed
from elixir_tune.paths import CONFIGS_DIR
from elixir_tune.plan import plan_from_dict


def _example() -> dict:
    return yaml.safe_load((CONFIGS_DIR / "plans" / "example.yaml").read_text())


def _peer(**engine):
    raw = _example()
    raw["engine"] = engine
    for chunk in raw["memory"]["chunks"]:
        chunk["offload"] = chunk["resident"] = False
    return plan_from_dict(raw)


def test_deepspeed_plan_maps_one_to_one():
    plan = _peer(name="deepspeed", zero_stage=3, offload_params=True, offload_optimizer=True, max_live_elements=1000)
    config = deepspeed_config(plan)
    zero = config["zero_optimization"]
    assert (
        zero["stage"] == 3 and zero["offload_param"] == {"device": "cpu"} and zero["stage3_max_live_parameters"] == 1000
    )
    assert zero["offload_optimizer"] == {"device": "cpu"}
    training = plan.training
    assert config["gradient_accumulation_steps"] == training.grad_accum_steps
    assert config["train_batch_size"] == training.micro_batch_size * training.grad_accum_steps * plan.world_size
    assert config["gradient_clipping"] == 0.0  # DeepSpeed's default would clip at 1.0
    runner = deepspeed_config(plan, runner=True)
    assert runner["gradient_accumulation_steps"] == 1 and runner["managed_gradient_accumulation"] is False


def test_chunk_engine_offload_share_maps_to_optimizer_offload_and_is_listed():
    raw = _example()
    chunks = raw["memory"]["chunks"]
    for index, chunk in enumerate(chunks):
        chunk["offload"], chunk["resident"] = index == 0, False
    plan = plan_from_dict(raw)
    zero = deepspeed_config(plan)["zero_optimization"]
    assert zero["stage"] == 3 and "offload_optimizer" in zero and "offload_param" not in zero
    notes = " ".join(deepspeed_unexpressed(plan))
    assert "offload share" in notes and "cache" in notes
    none = copy.deepcopy(raw)
    for chunk in none["memory"]["chunks"]:
        chunk["offload"] = False
    assert "offload_optimizer" not in deepspeed_config(plan_from_dict(none))["zero_optimization"]


def test_fsdp2_first_units_offload_is_listed():
    plan = _peer(name="fsdp2", offload_params=True, offload_optimizer=True, offload_units=1)
    zero = deepspeed_config(plan)["zero_optimization"]
    assert zero["stage"] == 3 and "offload_param" in zero
    assert any("first 1 FSDP2 units" in note for note in deepspeed_unexpressed(plan))


def test_on_engine_maps_a_chunk_plan_to_valid_peer_plans():
    from elixir_tune.export.peer_plans import on_engine
    from elixir_tune.plan import validate

    raw = _example()
    for index, chunk in enumerate(raw["memory"]["chunks"]):
        chunk["offload"], chunk["resident"] = index == 0, False
    plan = plan_from_dict(raw)
    fsdp2 = on_engine(plan, "fsdp2")
    assert fsdp2.engine.name == "fsdp2" and fsdp2.engine.offload_params and not validate(fsdp2)
    deepspeed = on_engine(plan, "deepspeed")
    assert deepspeed.engine.zero_stage == 3 and deepspeed.engine.offload_optimizer and not validate(deepspeed)
    assert not any(chunk.offload for chunk in deepspeed.memory.chunks) and plan.memory.chunks[0].offload
