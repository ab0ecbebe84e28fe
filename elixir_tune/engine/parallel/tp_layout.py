"""How a full parameter maps to a tensor rank's piece, and back: ``Layout`` and ``mesh_coords``.

Plain tensor arithmetic on the full and local values (no DTensor, no process group): the engine's
``TensorSplit`` (tensor_parallel.py) uses it to split loaded weights and to assemble full state
dicts, the adapters (tp_adapters.py, tp_grid.py) to place each rank's piece in its DTensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class TensorParallelError(ValueError):
    """The model or plan cannot run tensor-parallel as asked (the message says what to change)."""


@dataclass(frozen=True)
class Layout:
    """One parameter's split over the tensor ranks (a 1-D tensor mesh, or Optimus's q x q grid).

    Attributes:
        dims: for each tensor mesh dimension, the parameter dimension it splits (None: the
            parameter is replicated along that mesh dimension).
        parts: a fused parameter holds ``parts`` equal tensors along its split output dimension
            (GPT-2's q | k | v): each is split, and a rank's piece is its block of each, concatenated.
        fused_dim: the dimension ``parts`` applies to.
    """

    dims: tuple[int | None, ...]
    parts: int = 1
    fused_dim: int | None = None

    @property
    def sharded(self) -> bool:
        return any(dim is not None for dim in self.dims)

    def replicas(self, sizes: tuple[int, ...]) -> int:
        """How many ranks of the tensor group hold the same piece."""
        return math.prod(size for size, dim in zip(sizes, self.dims, strict=True) if dim is None)

    def local(self, full: torch.Tensor, coords: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The piece of ``full`` at mesh coordinates ``coords`` of a tensor mesh of ``sizes``."""
        piece = full
        for dim, index, count in zip(self.dims, coords, sizes, strict=True):
            if dim is None:
                continue
            if self.parts == 1 or dim != self.fused_dim:
                piece = piece.chunk(count, dim)[index]
            else:
                piece = torch.cat([part.chunk(count, dim)[index] for part in piece.chunk(self.parts, dim)], dim)
        return piece

    def local_runs(
        self, shape: tuple[int, ...], coords: tuple[int, ...], sizes: tuple[int, ...]
    ) -> list[list[tuple[int, int]]]:
        """Where the piece at ``coords`` lies in the full tensor, dimension by dimension.

        For each dimension of a tensor of ``shape``, the ``[begin, end)`` runs of full indices the
        piece holds, in the piece's order (one run for an ordinary split, one per fused part for
        GPT-2's q | k | v): the piece is the full tensor indexed by the product of the runs, what
        :meth:`local` returns, so a reader can fetch just those slices of a file.
        """
        runs = []
        for axis, length in enumerate(shape):
            index = torch.arange(length)
            for dim, coord, count in zip(self.dims, coords, sizes, strict=True):
                if dim != axis:
                    continue
                if self.parts == 1 or dim != self.fused_dim:
                    index = index.chunk(count)[coord]
                else:
                    index = torch.cat([part.chunk(count)[coord] for part in index.chunk(self.parts)])
            runs.append(_runs(index.tolist()))
        return runs

    def full(self, pieces: list[torch.Tensor], shape: torch.Size, sizes: tuple[int, ...]) -> torch.Tensor:
        """The full parameter of ``shape`` from every rank's piece (tensor ranks in row-major mesh order)."""
        if not self.sharded:
            return pieces[0]
        # Where each rank's elements sit: its piece of the full tensor's flat indices.
        index = torch.arange(math.prod(shape)).view(shape)
        out = torch.empty(math.prod(shape), dtype=pieces[0].dtype)
        for rank, piece in enumerate(pieces):
            out[self.local(index, mesh_coords(rank, sizes), sizes).reshape(-1)] = piece.reshape(-1)
        return out.view(shape)


def mesh_coords(rank: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor rank's coordinates on its tensor mesh (row-major: the last dimension innermost)."""
    coords = []
    for size in reversed(sizes):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Consecutive integers grouped: [0, 1, 2, 6, 7] -> [(0, 3), (6, 8)]."""
    out: list[tuple[int, int]] = []
    for value in indices:
        if out and out[-1][1] == value:
            out[-1] = (out[-1][0], value + 1)
        else:
            out.append((value, value + 1))
    return out
