"""Host buffers that cost memory only once they are written.

A gradient shard or an optimizer-state shard in host memory is all zeros until the first backward
or optimizer step writes it. ``torch.zeros`` writes every page at allocation, so a rank that has
only just set up already holds them all (for GPT-2 large at world 2 on a CPU device, 1.5 GB of
gradient shard beside its 1.45 GB of weights). An anonymous memory mapping reads as zeros and the
kernel provides its pages when they are first touched: setup holds the weights, training holds what
it uses when it uses it.
"""

from __future__ import annotations

import mmap

import torch


def zeros_on_demand(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero-filled CPU tensor of ``numel`` elements whose pages become resident when first written.

    Args:
        numel: elements.
        dtype: element type.

    Returns:
        A contiguous 1-D CPU tensor (not pinned); the mapping lives as long as the tensor.
    """
    if numel == 0:
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, numel * dtype.itemsize), dtype=dtype)
