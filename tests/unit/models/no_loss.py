"""A model whose forward returns logits, not a loss (the profiler must refuse it)."""

import torch
from torch import nn


def build_model():
    return nn.Linear(8, 8)


def example_batch(batch_size, seq_len):
    return {"input": torch.randn(batch_size, seq_len, 8)}
