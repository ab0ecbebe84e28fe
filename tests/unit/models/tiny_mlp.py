"""A small non-transformers model for profiler tests: embedding, a ModuleList of residual MLP
blocks, an output head tied to the embedding, and a scalar loss returned directly."""

import torch
from torch import nn

VOCAB, WIDTH = 32, 16


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyMLP(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(width))

    def forward(self, tokens, targets):
        x = self.embed(tokens) * self.scale
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def build_model():
    return TinyMLP()


def build_deep():
    return TinyMLP(depth=5)


def example_batch(batch_size, seq_len):
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len))
    return {"tokens": tokens, "targets": tokens}
