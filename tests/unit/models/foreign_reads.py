"""Small models whose modules read parameters they do not own, for the profiler's foreign reads
and the engine's gathering of them (no transformers).

Each block has:
    mixer   owns nothing; calls its child ``gate`` and reads its child ``conv``'s weight and bias
            with a functional call (``conv`` is never called): a parent reading a child's weight;
    left    owns ``weight`` and also reads the sibling ``right``'s weight (held outside the module
            tree): a functional call on a sibling's parameter; ``right`` is called too;
    scale   a parameter registered on ``left`` and ``right`` both (shared: each owns it).
The head is tied to the embedding (each owns the weight), and the model's own forward reads
``final.weight`` outside ``final`` (the model is the reader).

``build_runtime_reader`` reads ``right``'s weight from ``mixer`` only when the input holds data
(not on the meta device): the profiler cannot see that read, the engine's first step must.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH = 32, 16


class Mixer(nn.Module):
    def __init__(self, width: int, peek=None) -> None:
        super().__init__()
        self.gate = nn.Linear(width, width)
        self.conv = nn.Linear(width, width)  # never called: its parameters are read by the mixer
        object.__setattr__(self, "peek", peek)  # a module read only at run time (not a child)

    def forward(self, x):
        y = torch.sigmoid(self.gate(x)) * F.linear(x, self.conv.weight, self.conv.bias)
        if self.peek is not None and not x.is_meta:
            y = y + F.linear(x, self.peek.weight)
        return y


class Left(nn.Module):
    def __init__(self, width: int, sibling: nn.Module, scale: nn.Parameter) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.scale = scale
        object.__setattr__(self, "sibling", sibling)  # not a child: the sibling is the block's

    def forward(self, x):
        return F.linear(x, self.weight) * self.scale + F.linear(x, self.sibling.weight)


class Right(nn.Module):
    def __init__(self, width: int, scale: nn.Parameter) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.scale = scale

    def forward(self, x):
        return F.linear(x, self.weight) * self.scale


class Block(nn.Module):
    def __init__(self, width: int, runtime_read: bool) -> None:
        super().__init__()
        scale = nn.Parameter(torch.ones(width))
        self.right = Right(width, scale)
        self.left = Left(width, self.right, scale)
        self.mixer = Mixer(width, peek=self.right if runtime_read else None)

    def forward(self, x):
        return x + self.mixer(torch.tanh(self.left(x) + self.right(x)))


class ForeignReads(nn.Module):
    def __init__(self, depth: int = 2, runtime_read: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH, runtime_read) for _ in range(depth))
        self.final = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = F.layer_norm(x, (WIDTH,), self.final.weight, self.final.bias)  # the model reads final's
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def build_model():
    return ForeignReads()


def build_runtime_reader():
    return ForeignReads(runtime_read=True)


def example_batch(batch_size, seq_len):
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len))
    return {"tokens": tokens, "targets": tokens}
