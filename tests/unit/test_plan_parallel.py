"""The plan's parallel section: validation, the stage assignment and the tensor layout table."""

from __future__ import annotations

import pytest

from elixir_tune.paths import CONFIGS_DIR
from elixir_tune.plan import ParallelPlan, load_plan, plan_from_dict, read_plan_dict, validate_dict
from elixir_tune.plan.io import dump_plan
from elixir_tune.plan.stages import assign_stages, block_index_of, schedule_problem, stage_of_block, virtual_stages
from elixir_tune.plan.tensor_layout import (
    grid_problem,
    in_region,
    is_norm_param,
    local_shape,
    split_dim,
    tensor_style,
)

EXAMPLE = CONFIGS_DIR / "plans" / "example.yaml"  # tiny GPT-2, world 2, 2 blocks


def _with(**sections) -> dict:
    raw = read_plan_dict(EXAMPLE)
    for path, value in sections.items():
        *parents, last = path.split("__")
        node = raw
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        node[int(last) if isinstance(node, list) else last] = value
    return raw


def test_a_plan_without_parallel_section_has_default_degrees_and_writes_none():
    plan = load_plan(EXAMPLE)
    assert plan.parallel == ParallelPlan()
    assert plan.data_parallel_size == plan.world_size == 2
    assert "parallel" not in dump_plan(plan)
    assert "stage" not in dump_plan(plan)  # chunks[].stage is written for pipeline plans only


def test_parallel_section_round_trips_and_sets_the_data_size():
    raw = _with(parallel__pipeline__stages=2, cluster__gpus_per_node=4)  # world 4 = data 2 x pipeline 2
    raw["memory"]["chunks"][2]["stage"] = 1  # block 1 and the final norm: stage 1 of 2 (modular)
    assert validate_dict(raw) == []
    plan = plan_from_dict(raw)
    assert plan.data_parallel_size == 2
    assert plan.parallel.pipeline.assignment == "modular"
    assert [chunk.stage for chunk in plan.memory.chunks] == [0, 0, 1]
    text = dump_plan(plan)
    assert "parallel:" in text and "stages: 2" in text and "stage: 1" in text
    assert validate_dict(read_plan_dict_text(text)) == []


def read_plan_dict_text(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)


def _pipeline(**sections) -> dict:
    """The example plan (tiny GPT-2, 2 blocks) as a valid 2-stage pipeline at world 4, then ``sections``."""
    return _with(
        **{"parallel__pipeline__stages": 2, "cluster__gpus_per_node": 4, "memory__chunks__2__stage": 1, **sections}
    )


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        (
            {"memory__chunks__2__stage": 0},
            "memory.chunks[2].stage: 0, but its parameters are on stage 1 (modular assignment of 2 blocks to 2 stages)",
        ),
        (
            {"memory__chunks__2__stage": 2},
            "memory.chunks[2].stage: 2, but parallel.pipeline.stages is 2 (stages 0 to 1)",
        ),
        (
            {"memory__chunks__1__params": ["transformer.wpe.weight", "transformer.h.1.ln_1.weight"]},
            "memory.chunks[1].params: parameters of pipeline stages [0, 1] in one chunk (modular assignment); "
            "a chunk holds one stage's parameters: pack each stage's apart",
        ),
        (
            {"parallel__pipeline__schedule": "gpipe", "model__num_blocks": 4},
            "parallel.pipeline.schedule: gpipe runs one virtual stage per rank, but the modular assignment of 4 "
            "blocks to 2 stages gives stage 0 2 non-contiguous runs of blocks; use looped_bfs, or assignment contiguous",
        ),
        (
            {"parallel__pipeline__schedule": "interleaved_1f1b", "model__num_blocks": 3},
            "parallel.pipeline.schedule: interleaved_1f1b needs the same number of virtual stages on every rank, but "
            "the modular assignment of 3 blocks to 2 stages gives the stages [2, 1]; use looped_bfs (it runs uneven "
            "splits), assignment contiguous, or a block count that is a multiple of 2",
        ),
        (
            {"parallel__pipeline__schedule": "1f1b", "training__grad_accum_steps": 1},
            "parallel.pipeline.schedule: 1f1b needs at least as many micro-batches per step as stages (2), got 1; "
            "raise training.grad_accum_steps or use gpipe or looped_bfs",
        ),
        (
            {"parallel__pipeline__schedule": "interleaved_1f1b", "training__grad_accum_steps": 5},
            "parallel.pipeline.schedule: interleaved_1f1b runs rounds of micro-batches (2 rounds for 5 micro-batches "
            "on 2 stages), and 5 is not a multiple of 2; make training.grad_accum_steps a multiple of 2 or less "
            "than 4, or use looped_bfs",
        ),
    ],
)
def test_bad_pipeline_chunks_are_reported_with_their_field_paths(sections, expected):
    problems = validate_dict(_pipeline(**sections))
    assert expected in problems, problems


@pytest.mark.parametrize(
    ("blocks", "stages"), [(blocks, stages) for blocks in range(2, 8) for stages in (2, 3, 4) if stages <= blocks]
)
def test_looped_bfs_runs_every_split_and_the_other_schedules_refuse_only_what_they_cannot_run(blocks, stages):
    for assignment in ("modular", "contiguous"):
        counts = [
            sum(1 for stage, _ in virtual_stages(blocks, stages, assignment) if stage == s) for s in range(stages)
        ]
        # Rank r holds virtual stages r, r + P, ...: the order torch's looped schedules assume.
        order = [stage for stage, _ in virtual_stages(blocks, stages, assignment)]
        assert order == [index % stages for index in range(len(order))]
        for micro_batches in (1, 2, 3, 4, 8):
            assert schedule_problem(blocks, stages, assignment, "looped_bfs", micro_batches) is None
            assert schedule_problem(blocks, stages, assignment, "gpipe", micro_batches) is None or max(counts) > 1
            one_each = schedule_problem(blocks, stages, assignment, "1f1b", micro_batches) is None
            assert one_each == (max(counts) == 1 and micro_batches >= stages)
            rounds = max(1, micro_batches // stages)
            even = schedule_problem(blocks, stages, assignment, "interleaved_1f1b", micro_batches) is None
            assert even == (len(set(counts)) == 1 and micro_batches % rounds == 0)
        if assignment == "contiguous":
            assert counts == [1] * stages


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
            # data size 1: global 16 = 4 x 2 x 1 no longer holds
            {"parallel__pipeline__stages": 2, "memory__chunks__2__stage": 1},
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


# Llama's table as the profiler records it (tests/unit/test_tensor_tables.py translates the real one).
LLAMA = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.embed_tokens": "vocab",
    "lm_head": "vocab",
    "model.layers.*.input_layernorm": "norm",
    "model.layers.*.post_attention_layernorm": "norm",
    "model.norm": "norm",
}


def test_tensor_layout_llama_gqa_and_gpt2_conv1d():
    assert tensor_style("model.layers.0.self_attn.k_proj.weight", "llama", LLAMA) == "colwise"
    assert tensor_style("model.layers.0.input_layernorm.weight", "llama", LLAMA) == "replicate"
    assert tensor_style("model.layers.0.self_attn.o_proj.bias", "llama", LLAMA) == "replicate"  # rowwise bias
    # nn.Linear [out, in]: column-parallel splits dim 0, row-parallel dim 1.
    assert local_shape("model.layers.0.self_attn.k_proj.weight", [64, 256], "llama", 2, table=LLAMA) == [32, 256]
    assert local_shape("model.layers.0.self_attn.k_proj.bias", [64], "llama", 2, table=LLAMA) == [32]
    assert local_shape("model.layers.0.mlp.down_proj.weight", [256, 688], "llama", 2, table=LLAMA) == [256, 344]
    assert local_shape("lm_head.weight", [1000, 256], "llama", 4, table=LLAMA) == [250, 256]
    # `*` is one path component: a longer or shorter path does not match.
    assert tensor_style("model.layers.0.x.self_attn.q_proj.weight", "llama", LLAMA) == "replicate"
    # Conv1D [in, out]: swapped (GPT-2's built-in table).
    assert split_dim("transformer.h.0.attn.c_attn.weight", [64, 192], "gpt2") == 1
    assert local_shape("transformer.h.0.mlp.c_proj.weight", [256, 64], "gpt2", 2) == [128, 64]
    assert local_shape("transformer.h.0.attn.c_proj.bias", [64], "gpt2", 2) == [64]
    # 2d over 2 x 2: matrices split on both dimensions, replicated vectors on their last.
    assert local_shape("model.layers.0.mlp.up_proj.weight", [688, 256], "llama", 4, "2d", LLAMA) == [344, 128]
    assert local_shape("model.norm.weight", [256], "llama", 4, "2d", LLAMA) == [128]
    with pytest.raises(ValueError, match="does not divide by 4"):
        local_shape("lm_head.weight", [1002, 256], "llama", 4, table=LLAMA)
    with pytest.raises(ValueError, match="no tensor-parallel table for model type 'bloom'"):
        tensor_style("x.weight", "bloom")


def test_2d_keeps_per_head_and_in_region_norms_whole():
    # Qwen3's q_norm (head_norm) and OLMo2's q_norm (unplaced, inside the attention) run on this rank's
    # samples as ordinary tensors: whole on every rank; the residual-stream norms and a row-parallel
    # bias are split by the hidden dimension over the grid columns.
    table = {**LLAMA, "model.layers.*.self_attn.k_norm": "head_norm"}
    assert local_shape("model.layers.0.self_attn.k_norm.weight", [8], "qwen3", 4, "2d", table) == [8]
    assert local_shape("model.layers.1.self_attn.q_norm.weight", [32], "olmo2", 4, "2d", table) == [32]
    assert local_shape("model.layers.0.self_attn.o_proj.bias", [32], "llama", 4, "2d", table) == [16]
    assert local_shape("model.layers.0.input_layernorm.weight", [32], "llama", 4, "2d", table) == [16]
    assert in_region("model.layers.3.mlp.act", table) and not in_region("model.layers.3.mlp", table)
    assert grid_problem(table) == ""
    moe = {
        **table,
        "model.layers.*.mlp.experts": "experts",
        "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    }
    assert grid_problem(moe) == (
        "2d tensor parallelism has no grid form for the tensor plan's style experts (mixture-of-experts experts), "
        "packed_colwise (packed expert tensors); use tensor mode 1d"
    )


def test_norm_parameters_by_family():
    assert is_norm_param("transformer.h.3.ln_2.bias", "gpt2") and is_norm_param("transformer.ln_f.weight", "gpt2")
    # A row-parallel bias: replicated, added after the reduction; its gradient is summed like a norm's.
    assert is_norm_param("transformer.h.3.attn.c_proj.bias", "gpt2")
    assert not is_norm_param("transformer.h.3.attn.c_attn.bias", "gpt2")  # split
    assert is_norm_param("model.layers.0.input_layernorm.weight", "llama", LLAMA)
    assert is_norm_param("model.norm.weight", "qwen2", LLAMA)
    assert not is_norm_param("model.layers.0.mlp.down_proj.weight", "mistral", LLAMA)
    assert not is_norm_param("model.decoder.final_layer_norm.weight", "opt")  # no tensor table


def test_pipeline_by_tensor_by_data_is_valid_and_factors_the_world():
    # world 8 = data 2 x pipeline 2 x tensor 2: global 16 = micro 4 x accumulation 2 x data 2
    raw = _pipeline(parallel__tensor__degree=2, cluster__gpus_per_node=8, model__num_heads=4, model__num_kv_heads=2)
    assert validate_dict(raw) == []
    plan = plan_from_dict(raw)
    assert (plan.data_parallel_size, plan.parallel.model_parallel_size) == (2, 4)


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        (
            {"parallel__tensor__degree": 2, "model__num_heads": 3},
            "parallel.tensor.degree: 2 does not divide model.num_heads 3; each tensor rank needs whole attention heads",
        ),
        (
            {"parallel__tensor__degree": 2, "model__unsupported_layouts": {"tensor": "no tensor plan"}},
            "parallel.tensor.degree: 2, but the engine cannot run tensor parallelism for this model: no tensor plan; "
            "set it to 1 (search again without --fix tensor=2)",
        ),
        (
            {"parallel__tensor__degree": 2, "parallel__pipeline__schedule": "gpipe", "model__num_blocks": 4},
            "parallel.pipeline.schedule: gpipe runs one virtual stage per rank, but the modular assignment of 4 "
            "blocks to 2 stages gives stage 0 2 non-contiguous runs of blocks; use looped_bfs, or assignment contiguous",
        ),
        (
            {"parallel__tensor__degree": 2, "training__loop": "plain"},
            "training.loop: plain",
        ),
    ],
)
def test_pipeline_by_tensor_refusals_say_why(sections, expected):
    raw = _pipeline(**{"cluster__gpus_per_node": 8, **sections})
    problems = validate_dict(raw)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_an_empty_layout_record_is_the_profiles_word_not_a_missing_one():
    # The profile checked the model itself and found nothing it cannot run: a family outside the
    # built-in list still gets its pipeline plan. Without a record, the family list answers.
    recorded = _pipeline(model__model_type="my_family", model__unsupported_layouts={})
    assert validate_dict(recorded) == []
    unrecorded = _pipeline(model__model_type="my_family")
    unrecorded["model"].pop("unsupported_layouts", None)
    problems = validate_dict(unrecorded)
    assert len(problems) == 1 and "cannot run pipeline parallelism for this model" in problems[0], problems
