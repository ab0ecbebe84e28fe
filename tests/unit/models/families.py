"""Small token models of the families beyond GPT-style LMs, built with transformers' own classes.

One builder per family (``families.py:build_bart`` names it; ``build_model`` is T5); all take token
ids and labels. The vision family is in ``vit_tiny.py``. Used by the profiler tests and the engine's
family equivalence tests.
"""

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

VOCAB = 128


def build_bart():
    config = BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    return BartForConditionalGeneration(config)


def build_t5():
    # Relative position bias: computed by the first block of each stack and shared by the others.
    config = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0,
    )  # fmt: skip
    return T5ForConditionalGeneration(config)


def build_moe():
    # Fused experts (transformers' grouped matmul), 4 experts, top-2, plus a shared expert.
    config = Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    return Qwen2MoeForCausalLM(config)


build_model = build_t5


def example_batch(batch_size: int, seq_len: int) -> dict:
    """Token ids and labels (encoder-decoder and causal LMs alike)."""
    return {
        "input_ids": torch.randint(1, VOCAB, (batch_size, seq_len)),
        "labels": torch.randint(1, VOCAB, (batch_size, seq_len)),
    }
