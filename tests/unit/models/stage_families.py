"""Tiny causal LMs of every family that runs on pipeline stages (plan/capabilities.py PIPELINE_MODEL_TYPES),
and of some that do not, built from transformers' own classes: the capability tests check each against
``stage_plans.py`` and the multi-process pipeline test trains them on 2 stages.

Every model: hidden 32, 4 heads (2 key/value heads where the family groups them), vocabulary 128, no
dropout, no key/value cache; ``blocks`` blocks (2 by default). Built under the caller's seed.
"""

from __future__ import annotations

from typing import Any

VOCAB = 128
NO_DROPOUT = dict(attention_dropout=0.0)
DECODER = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, max_position_embeddings=64)
GQA = dict(DECODER, intermediate_size=64, num_key_value_heads=2)

# model_type -> (config class, causal LM class, config fields; the block count is added by ``build``).
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
        vocab_size=VOCAB, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(
        DECODER, ffn_dim=64, word_embed_proj_dim=32, dropout=0.0, layerdrop=0.0, pad_token_id=1, **NO_DROPOUT)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(GQA)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(GQA, sliding_window=4, **NO_DROPOUT)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(GQA, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(GQA, head_dim=8, **NO_DROPOUT)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        GQA, head_dim=8, query_pre_attn_scalar=8, sliding_window=4, **NO_DROPOUT)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        DECODER, intermediate_size=64, hidden_dropout=0.0, **NO_DROPOUT)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(
        vocab_size=VOCAB, n_embd=32, n_head=4, n_positions=64, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        GQA, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, **NO_DROPOUT)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(GQA, pad_token_id=1, **NO_DROPOUT)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        GQA, embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.25,
        **NO_DROPOUT)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        GQA, moe_intermediate_size=32, head_dim=8, num_experts=4, num_experts_per_tok=2, **NO_DROPOUT)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        GQA, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        **NO_DROPOUT)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        GQA, head_dim=8, num_local_experts=4, num_experts_per_tok=2, **NO_DROPOUT)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        DECODER, intermediate_size=64, moe_intermediate_size=16, first_k_dense_replace=1, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, **NO_DROPOUT)),
    # Families without a pipeline plan (transformers ships none and we keep no table).
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, **NO_DROPOUT)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, n_head=4, hidden_dropout=0.0, pad_token_id=3, **NO_DROPOUT)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(GQA, hidden_dropout=0.0, **NO_DROPOUT)),
}  # fmt: skip
BLOCK_FIELD = {"gpt2": "n_layer", "gptj": "n_layer", "bloom": "n_layer"}


def build(model_type: str, blocks: int = 2, meta: bool = False):
    """The tiny causal LM of ``model_type`` with ``blocks`` blocks (on the meta device with ``meta``)."""
    import torch
    import transformers

    config_class, model_class, fields = FAMILIES[model_type]
    config = getattr(transformers, config_class)(
        **fields, **{BLOCK_FIELD.get(model_type, "num_hidden_layers"): blocks}, use_cache=False
    )
    with torch.device("meta") if meta else torch.device("cpu"):
        return getattr(transformers, model_class)(config)
