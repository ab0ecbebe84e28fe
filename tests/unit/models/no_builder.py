"""A model file without build_model()."""

import torch


def example_batch(batch_size, seq_len):
    return {"x": torch.zeros(batch_size, seq_len)}
