"""A tiny Mamba causal LM (transformers' MambaForCausalLM): its mixer reads ``conv1d.weight``,
``conv1d.bias``, ``dt_proj.weight`` and ``dt_proj.bias`` directly (functional calls) instead of
calling those modules, so the engine must gather them for the mixer (the profile's foreign reads)."""

import torch
from transformers import MambaConfig, MambaForCausalLM

VOCAB = 128


def build_model():
    config = MambaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
        time_step_rank=4, use_cache=False,
    )  # fmt: skip
    return MambaForCausalLM(config)


def example_batch(batch_size: int, seq_len: int) -> dict:
    ids = torch.randint(1, VOCAB, (batch_size, seq_len))
    return {"input_ids": ids, "labels": ids.clone()}
