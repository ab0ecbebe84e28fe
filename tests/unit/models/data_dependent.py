"""A model whose router keeps only some rows (a data-dependent shape): it trains, but cannot run on meta."""

import torch
from torch import nn


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 2)

    def forward(self, x):
        keep = self.gate(x)[:, 0] > 0
        return x[keep]  # how many rows survive depends on the values


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.router = Router()

    def forward(self, x):
        return self.router(self.proj(x)).pow(2).mean()


def build_model():
    return DataDependent()


def example_batch(batch_size: int, seq_len: int) -> dict:
    return {"x": torch.randn(batch_size, 8)}
