"""Memory-bound elementwise work: the bytes a model's pointwise ops write.

A transformer's time is not only its FLOPs. Its pointwise ops (activations, residual adds, masks,
scalings) each read and write whole activations at memory speed, and how many a model runs
depends on how its code is written: transformers' GPT-2 builds its tanh-GELU from eight separate
ops where ``F.gelu(approximate="tanh")`` is one (measured on the CPU: a GPT-2 block with the
former takes 1.2x the time of the same block with the latter). A block rate measured on one block
cannot know that about another model's block; bytes counted per op can.

The rule, shared by the profiler (a model on the meta device) and the hardware probe (its own
block, and the pointwise bandwidth): an ATen op tagged ``pointwise`` that no FLOP formula covers
counts the bytes of the tensors it returns. Imports torch: only the profiler and the probe use it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

_FLOP_FORMULAS = getattr(flop_counter, "flop_registry", {})


def pointwise_bytes(func: Any, out: Any) -> int:
    """Bytes an op writes if it is memory-bound pointwise work, else 0.

    Args:
        func: the ATen op (an ``OpOverload``, as a dispatch mode sees it).
        out: what it returned.

    Returns:
        The bytes of its output tensors when the op is tagged pointwise and has no FLOP formula.
    """
    if torch.Tag.pointwise not in getattr(func, "tags", ()) or func._overloadpacket in _FLOP_FORMULAS:
        return 0
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    return sum(t.numel() * t.element_size() for t in outputs if isinstance(t, torch.Tensor))


class PointwiseCounter(TorchDispatchMode):
    """Counts ``pointwise_bytes`` of every op run under it (real or meta tensors).

    Attributes:
        bytes: the bytes counted so far.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.bytes += pointwise_bytes(func, out)
        return out
