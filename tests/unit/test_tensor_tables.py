"""Tensor tables translated from transformers' own ``base_model_tp_plan`` (plan/tensor_layout.py,
tensor_table.py): real tiny models on the meta device, one table per family, refused families say why."""

from __future__ import annotations

import pytest
import torch

from elixir_tune.models.tensor_table import model_tensor_table
from elixir_tune.plan.tensor_layout import BUILTIN_TABLES, local_shape, module_style, tensor_table, with_expert_entries

SMALL = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
    vocab_size=256, pad_token_id=0,
)  # fmt: skip


def _table(model_type: str) -> tuple[dict[str, str], str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **SMALL)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model_tensor_table(model)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gpt_neox", "phi3", "olmo2", "granite", "gptj"])
def test_families_with_a_plan_get_a_table_that_splits_every_linear(family):
    table, why = _table(family)
    assert why == "" and table
    styles = set(table.values())
    assert (
        {"vocab", "norm"} <= styles and styles & {"colwise", "colwise_gather"} and styles & {"rowwise", "rowwise_split"}
    )


def test_the_translation_keeps_each_style():
    qwen3, _ = _table("qwen3")
    assert module_style("model.layers.1.self_attn.q_proj", qwen3) == "colwise"
    assert module_style("model.layers.1.self_attn.q_norm", qwen3) == "head_norm"  # per head, gradient summed
    assert module_style("model.layers.0.input_layernorm", qwen3) == "norm"
    assert module_style("model.embed_tokens", qwen3) == module_style("lm_head", qwen3) == "vocab"
    phi3, _ = _table("phi3")  # q | k | v of unequal widths fused: the output is gathered whole
    assert module_style("model.layers.0.self_attn.qkv_proj", phi3) == "colwise_gather"
    assert module_style("model.layers.0.self_attn.o_proj", phi3) == "rowwise_split"
    neox, _ = _table("gpt_neox")  # its plan splits the embedding itself (embedding_rowwise)
    assert module_style("gpt_neox.embed_in", neox) == module_style("lm_head", neox) == "vocab"
    assert local_shape("gpt_neox.layers.0.attention.query_key_value.weight", [192, 64], "gpt_neox", 2, table=neox) == [
        96,
        64,
    ]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_mixture_of_experts_tables_split_each_expert(family):
    table, why = _table(family)
    assert why == ""
    assert module_style("model.layers.1.mlp.experts", table) == "experts"
    assert module_style("model.layers.1.mlp.gate", table) is None  # the router: replicated
    # gate | up [experts, 2 I, hidden]: each half split (a rank holds [gate_r | up_r]); down by its input.
    assert local_shape("model.layers.0.mlp.experts.gate_up_proj", [4, 256, 64], family, 2, table=table) == [4, 128, 64]
    assert local_shape("model.layers.0.mlp.experts.down_proj", [4, 64, 128], family, 2, table=table) == [4, 64, 64]
    with pytest.raises(ValueError, match="does not divide by 4"):  # I = 3: the halves do not split
        local_shape("model.layers.0.mlp.experts.gate_up_proj", [4, 6, 64], family, 2, table=table)


# The two layouts of transformers' Qwen3-MoE plans: up to 5.24 the experts sit in the tensor plan; from
# 5.25 the tensor plan leaves them out and the expert plan alone names them.
ATTENTION = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
TP_EXPERTS = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts.down_proj": "rowwise",
              "layers.*.mlp.experts": "moe_tp_experts"}  # fmt: skip
EP_PLAN = {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm", "layers.*.mlp.experts.down_proj": "grouped_gemm",
           "layers.*.mlp.experts": "ep_dispatch_experts"}  # fmt: skip


def test_both_transformers_layouts_of_the_experts_give_one_table():
    old_layout = with_expert_entries({**ATTENTION, **TP_EXPERTS}, EP_PLAN)
    new_layout = with_expert_entries(ATTENTION, EP_PLAN)
    assert old_layout == new_layout == {**ATTENTION, **TP_EXPERTS}
    assert with_expert_entries(ATTENTION, None) == ATTENTION  # a dense family: nothing added
    # A grouped tensor of a name the split rule does not know keeps its expert style, refused by name.
    odd = with_expert_entries(ATTENTION, {**EP_PLAN, "layers.*.mlp.experts.w13": "grouped_gemm"})
    modules = [("model.layers.0.mlp.experts", "Experts", True)]
    table, why = tensor_table("x", odd, "model", modules, ("", ""))
    assert table == {} and "grouped_gemm (layers.*.mlp.experts.w13)" in why


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_mixture_of_experts_families_split_their_experts_under_this_transformers(family):
    table, why = _table(family)
    assert why == ""
    assert module_style("model.layers.0.mlp.experts", table) == "experts"
    assert module_style("model.layers.0.mlp.experts.gate_up_proj", table) == "packed_colwise"
    assert module_style("model.layers.0.mlp.experts.down_proj", table) == "rowwise"


def test_mixture_of_experts_plans_the_engine_cannot_run_are_refused_whole():
    table, why = _table("deepseek_v3")  # latent attention: its plan leaves the attention's linears out
    assert table == {} and "kv_a_proj_with_mqa" in why
    modules = [("model.layers.0.mlp", "Moe", False), ("model.layers.0.mlp.experts", "Experts", True),
               ("model.layers.0.mlp.shared.up", "Linear", True), ("model.layers.0.mlp.shared.down", "Linear", True)]  # fmt: skip
    moe = {"layers.*.mlp.experts": "moe_tp_experts", "layers.*.mlp.experts.gate_up_proj": "packed_colwise"}
    shared = {"layers.*.mlp.shared.up": "colwise", "layers.*.mlp.shared.down": "rowwise"}
    table, why = tensor_table("x", {**moe, **shared}, "model", modules, ("", ""))
    assert table == {} and "split linears beside the experts" in why and "model.layers.0.mlp.shared.up" in why
    table, why = tensor_table("x", {"layers.*.mlp.up": "packed_colwise"}, "model", modules[:1], ("", ""))
    assert table == {} and "packs gate | up outside a mixture-of-experts module" in why


@pytest.mark.parametrize("family", ["opt", "falcon", "bloom", "stablelm"])
def test_families_without_a_plan_are_refused(family):
    table, why = _table(family)
    assert table == {} and f"model type {family!r} ships no tensor plan" in why


def test_gpt2_has_the_built_in_table_and_loose_modules_are_refused():
    table, why = _table("gpt2")
    assert why == "" and table == BUILTIN_TABLES["gpt2"]
    # A module with parameters on the residual stream that the plan does not place: refused, not half split.
    plan = {"layers.*.attn.q": "colwise", "layers.*.attn.o": "rowwise"}
    modules = [("model.layers.0.attn.q", "Linear", True), ("model.layers.0.attn.o", "Linear", True),
               ("model.layers.0.gate", "Linear", True), ("model.layers.0.ln", "MyRMSNorm", True)]  # fmt: skip
    table, why = tensor_table("x", plan, "model", modules, ("", ""))
    assert table == {} and "model.layers.0.gate (Linear)" in why
    table, why = tensor_table("x", plan, "model", modules[:2] + modules[3:], ("", ""))
    assert why == "" and table["model.layers.*.ln"] == "norm"
