"""A builder that raises (the profiler must show its message)."""

import torch


def build_model():
    raise ValueError("width 7 is not divisible by 2 heads")


def example_batch(batch_size, seq_len):
    return {"x": torch.zeros(batch_size, seq_len)}
