"""Selective activation checkpointing in the plan, the profile, the cost model and the search (the engine
against plain PyTorch: tests/distributed/test_selective_checkpointing.py)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from elixir_tune.costmodel.memory import activation_bytes
from elixir_tune.costmodel.model import CostModel
from elixir_tune.costmodel.parallel import Layout
from elixir_tune.hardware import load_hardware
from elixir_tune.paths import CONFIGS_DIR
from elixir_tune.plan import dump_plan, load_plan, plan_to_dict, validate_dict
from elixir_tune.plan.io import plan_from_dict
from elixir_tune.profiler import profile_model
from elixir_tune.search import search
from elixir_tune.search.joint import checkpoint_choices
from elixir_tune.search.space import parse_fixed

EXAMPLE = CONFIGS_DIR / "plans" / "example.yaml"
SEQ = 32
# llama-tiny: hidden 64, 4 heads of which 2 key/value heads (k and v project to 32), MLP 128, 2 blocks.
HIDDEN, KV, FFN, BLOCKS = 64, 32, 128, 2


@pytest.fixture(scope="module")
def profile():
    return profile_model("llama-tiny", batch_size=1, seq_len=SEQ, dtype="fp32")


@pytest.fixture(scope="module")
def model(profile):
    return CostModel(profile, load_hardware("cpu"), gpus_per_node=2)


def test_plan_keeps_full_checkpointing_files_as_they_were_and_reads_selective():
    plan = load_plan(EXAMPLE)
    assert plan.training.activation_checkpointing.mode == "full"
    written = yaml.safe_load(dump_plan(plan))["training"]["activation_checkpointing"]
    assert written == {"every": plan.training.activation_checkpointing.every}  # reads as before the field
    raw = plan_to_dict(plan)
    raw["training"]["activation_checkpointing"] = {"every": 1, "mode": "selective"}
    assert validate_dict(raw) == []
    selective = plan_from_dict(raw)
    assert selective.training.activation_checkpointing.mode == "selective"
    assert "mode: selective" in dump_plan(selective)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (dict(every=0), "selective, but every is 0"),
        (dict(accumulation="layered"), "selective with layered accumulation"),
        (dict(tensor=2), "selective with tensor parallelism"),
    ],
)
def test_validate_refuses_selective_where_it_cannot_run(change, expected):
    raw = plan_to_dict(load_plan(EXAMPLE))
    raw["training"]["activation_checkpointing"] = {"every": change.get("every", 1), "mode": "selective"}
    if "accumulation" in change:
        raw["training"]["accumulation"] = change["accumulation"]
    if "tensor" in change:
        raw["parallel"] = {"tensor": {"degree": change["tensor"]}}
    assert any(expected in problem for problem in validate_dict(raw)), validate_dict(raw)


def test_fix_selective_sets_the_mode_and_the_blocks():
    assert parse_fixed(["checkpointing=selective"]) == {"checkpointing": 1, "checkpoint_mode": "selective"}
    assert parse_fixed(["checkpointing=selective:2"]) == {"checkpointing": 2, "checkpoint_mode": "selective"}
    assert parse_fixed({"checkpointing": "all"}) == {"checkpointing": 1}
    with pytest.raises(ValueError, match="checkpoint_mode=partial: expected one of full, selective"):
        parse_fixed(["checkpoint_mode=partial"])


def test_profile_traces_torchtitans_policy(profile):
    """Recomputed: the 2nd, 4th and 6th matrix products of each block (k, o and up projections), no
    attention; kept: more than full checkpointing, less than none."""
    selective = profile.selective
    assert selective is not None
    recomputed_macs = HIDDEN * KV + HIDDEN * HIDDEN + HIDDEN * FFN  # per token and block
    assert selective.recompute_flops_per_sample == 2 * recomputed_macs * SEQ * BLOCKS
    assert 0 < selective.recompute_flops_per_sample < profile.recompute_flops_per_sample
    assert 0 < selective.recompute_pointwise_bytes_per_sample <= profile.recompute_pointwise_bytes_per_sample
    full, plain = profile.activation_checkpointed.per_sample_bytes, profile.activation.per_sample_bytes
    assert full < selective.activation.per_sample_bytes < plain


def test_cost_model_prices_what_selective_keeps_and_recomputes(model, profile):
    none, full = (activation_bytes(profile, 4, every, "fp32") for every in (0, 1))
    selective = activation_bytes(profile, 4, 1, "fp32", selective=True)
    assert full < selective < none
    assert selective == profile.selective.activation.at(4)
    _, full_recompute_s = model.compute_s(4, 1)
    _, selective_recompute_s = model.compute_s(4, 1, selective=True)
    assert 0 < selective_recompute_s < full_recompute_s
    assert model.compute_s(4, 0, selective=True) == model.compute_s(4, 0)  # nothing checkpointed
    older = dataclasses.replace(profile, selective=None)
    with pytest.raises(ValueError, match="profile the model again"):
        activation_bytes(older, 4, 1, "fp32", selective=True)


def test_search_offers_selective_on_every_block_beside_data_parallelism_only(model, profile):
    assert (1, True) in checkpoint_choices(model, {})
    assert checkpoint_choices(model, parse_fixed({"checkpointing": "all"})) == [(1, False)]
    assert checkpoint_choices(model, parse_fixed({"checkpointing": "selective:2"})) == [(2, True)]
    tensor = CostModel(profile, load_hardware("cpu"), gpus_per_node=2, layout=Layout(tensor=2))
    assert all(not selective for _, selective in checkpoint_choices(tensor, {}))
    assert checkpoint_choices(tensor, parse_fixed({"checkpointing": "selective"})) == []
    older = CostModel(dataclasses.replace(profile, selective=None), load_hardware("cpu"), gpus_per_node=2)
    assert all(not selective for _, selective in checkpoint_choices(older, {}))
    with pytest.raises(ValueError, match="no selective-checkpointing figures"):
        checkpoint_choices(older, parse_fixed({"checkpointing": "selective"}))


def test_pinned_selective_search_writes_a_selective_plan(profile):
    fixed = {"checkpointing": "selective", "micro_batch_size": 2, "pipeline": 1, "tensor": 1}
    result = search(profile, load_hardware("cpu"), gpus_per_node=2, global_batch_size=8, fixed=fixed)
    checkpointing = result.plan.training.activation_checkpointing
    assert (checkpointing.every, checkpointing.mode) == (1, "selective")
    assert result.candidates[0].row()["checkpoint_mode"] == "selective"
    assert validate_dict(plan_to_dict(result.plan)) == []
