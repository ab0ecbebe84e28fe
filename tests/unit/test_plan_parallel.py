"""The plan's parallel section: validation, the stage assignment and the tensor layout table."""

from __future__ import annotations

import pytest

from elixir_tune.paths import CONFIGS_DIR
from elixir_tune.plan import ParallelPlan, load_plan, plan_from_dict, read_plan_dict, validate_dict
from elixir_tune.plan.io import dump_plan
from elixir_tune.plan.stages import assign_stages, block_index_of, stage_of_block
from elixir_tune.plan.tensor_layout import local_shape, split_dim, tensor_style

EXAMPLE = CONFIGS_DIR / "plans" / "example.yaml"  # tiny GPT-2, world 2, 2 blocks


def _with(**sections) -> dict:
    raw = read_plan_dict(EXAMPLE)
    for path, value in sections.items():
        *parents, last = path.split("__")
        node = raw
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return raw


def test_a_plan_without_parallel_section_has_default_degrees_and_writes_none():
    plan = load_plan(EXAMPLE)
    assert plan.parallel == ParallelPlan()
    assert plan.data_parallel_size == plan.world_size == 2
    assert "parallel" not in dump_plan(plan)


def test_parallel_section_round_trips_and_sets_the_data_size():
    raw = _with(parallel__pipeline__stages=2, cluster__gpus_per_node=4)  # world 4 = data 2 x pipeline 2
    assert validate_dict(raw) == []
    plan = plan_from_dict(raw)
    assert plan.data_parallel_size == 2
    assert plan.parallel.pipeline.assignment == "modular"
    text = dump_plan(plan)
    assert "parallel:" in text and "stages: 2" in text


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        (
            {"parallel__pipeline__stages": 3},
            "parallel: pipeline stages 3 x tensor degree 1 = 3 does not divide the world size 2 "
            "(cluster.nodes x cluster.gpus_per_node); pick degrees whose product divides it",
        ),
        (
            {"parallel__pipeline__stages": 2, "model__num_blocks": 1, "training__global_batch_size": 8},
            "parallel.pipeline.stages: 2 stages but the model has 1 repeated blocks (model.num_blocks); "
            "a stage needs at least one block",
        ),
        (
            {"parallel__tensor__degree": 2, "parallel__tensor__mode": "2d", "training__global_batch_size": 8},
            "parallel.tensor.degree: mode 2d needs a square degree q x q of at least 4 (2 x 2), got 2",
        ),
        (
            {"parallel__tensor__degree": 2, "model__num_heads": 3, "training__global_batch_size": 8},
            "parallel.tensor.degree: 2 does not divide model.num_heads 3; each tensor rank needs whole attention heads",
        ),
        (
            {"parallel__tensor__mode": "3d"},
            "parallel.tensor.mode: unknown value '3d' (expected one of 1d, 2d)",
        ),
        (
            {"parallel__pipeline__stages": 2},  # data size 1: global 16 = 4 x 2 x 1 no longer holds
            "training.global_batch_size: 16 is not micro_batch_size 4 x grad_accum_steps 2 x data-parallel size 1 = 8",
        ),
    ],
)
def test_bad_parallel_sections_are_reported_with_their_field_paths(sections, expected):
    assert validate_dict(_with(**sections)) == [expected]


def test_stage_of_block_modular_and_contiguous():
    assert [stage_of_block(i, 8, 2, "modular") for i in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [stage_of_block(i, 8, 2, "contiguous") for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    # 7 blocks over 3 stages: 3, 2, 2
    assert [stage_of_block(i, 7, 3, "contiguous") for i in range(7)] == [0, 0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="outside"):
        stage_of_block(8, 8, 2, "modular")


def test_assign_stages_puts_embeddings_first_and_the_head_with_the_last_block():
    names = ["wte.weight", "h.0.w", "h.1.w", "h.2.w", "h.3.w", "ln_f.weight", "head.weight"]
    stages = assign_stages(names, "h", 4, 2, "modular")
    assert stages == {
        "wte.weight": 0,
        "h.0.w": 0,
        "h.1.w": 1,
        "h.2.w": 0,
        "h.3.w": 1,
        "ln_f.weight": 1,
        "head.weight": 1,
    }
    assert set(assign_stages(names, "h", 4, 1, "modular").values()) == {0}
    assert block_index_of("h.12.attn.weight", "h") == 12 and block_index_of("hx.1.w", "h") is None


def test_tensor_layout_llama_gqa_and_gpt2_conv1d():
    assert tensor_style("model.layers.0.self_attn.k_proj.weight", "llama") == "colwise"
    assert tensor_style("model.layers.0.input_layernorm.weight", "llama") == "replicate"
    # nn.Linear [out, in]: column-parallel splits dim 0, row-parallel dim 1.
    assert local_shape("model.layers.0.self_attn.k_proj.weight", [64, 256], "llama", 2) == [32, 256]
    assert local_shape("model.layers.0.mlp.down_proj.weight", [256, 688], "llama", 2) == [256, 344]
    assert local_shape("lm_head.weight", [1000, 256], "llama", 4) == [250, 256]
    # Conv1D [in, out]: swapped.
    assert split_dim("transformer.h.0.attn.c_attn.weight", [64, 192], "gpt2") == 1
    assert local_shape("transformer.h.0.mlp.c_proj.weight", [256, 64], "gpt2", 2) == [128, 64]
    assert local_shape("transformer.h.0.attn.c_proj.bias", [64], "gpt2", 2) == [64]
    # 2d over 2 x 2: matrices split on both dimensions, replicated vectors on their last.
    assert local_shape("model.layers.0.mlp.up_proj.weight", [688, 256], "llama", 4, "2d") == [344, 128]
    assert local_shape("model.norm.weight", [256], "llama", 4, "2d") == [128]
    with pytest.raises(ValueError, match="does not divide by 4"):
        local_shape("lm_head.weight", [1002, 256], "llama", 4)
    with pytest.raises(ValueError, match="no tensor-parallel layout"):
        tensor_style("x.weight", "bloom")
