"""A small vision transformer for image classification: pixel values in, no token ids."""

import torch
from transformers import ViTConfig, ViTForImageClassification

IMAGE, PATCH, CLASSES = 32, 8, 10


def build_model():
    config = ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=IMAGE,
        patch_size=PATCH, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return ViTForImageClassification(config)


def example_batch(batch_size: int, seq_len: int) -> dict:
    """Pixel values and class labels (seq_len is unused: the patch count is fixed by the config)."""
    return {
        "pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE),
        "labels": torch.randint(0, CLASSES, (batch_size,)),
    }
