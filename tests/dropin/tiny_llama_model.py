"""The tiny Llama that the Trainer, TRL and accelerate scripts of tests/dropin/ train (built from a config)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 128


def config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip


def build_model():
    return LlamaForCausalLM(config())


def example_batch(batch_size, seq_len):
    ids = torch.randint(0, VOCAB, (batch_size, seq_len))
    return {"input_ids": ids, "labels": ids}


def token_rows(count: int = 160, length: int = 32) -> list[list[int]]:
    """The training data: random tokens, the same on every rank and in every run."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (length,), generator=generator).tolist() for _ in range(count)]
