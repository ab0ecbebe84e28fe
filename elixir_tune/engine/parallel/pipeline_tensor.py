"""Pipeline stages whose modules are tensor-parallel: what crosses a stage boundary.

With pipeline P and tensor T in one plan (world = data x P x T, ``engine/comm/mesh.py``'s ``Mesh``), the
model is first split over its tensor group (``tensor_parallel.py``) and then cut into stages
(``pipeline_stages.py``): each rank runs its stage's modules on its tensor-parallel pieces. Stage s at
tensor index t sends to stage s + 1 at the same tensor index (the pipeline group is
``(data, *, tensor)``), so the T ranks of a stage each talk to their own peer.

What crosses is the residual stream, in the layout it has between tensor-parallel blocks (that of the
embedding's output):

* with sequence parallelism (the default) each tensor rank holds a shard of every sample's tokens,
  ``(batch, seq / T, hidden)``, and the next stage's rank at the same tensor index needs exactly
  that shard: it is sent as it is (``leave``: the DTensor's local tensor) and taken up as the same
  DTensor (``enter``), with no tensor-group traffic and 1 / T of the bytes (as
  ``costmodel/parallel.py`` ``tp_boundary_factor`` prices it); the gradients go back the same way;
* on the 2d grid (``tp_grid.py``) each rank holds its grid row's samples and its grid column's
  hidden features, ``(batch / q, seq, hidden / q)``: sent and taken up the same way (1 / T of the bytes);
* without either the stream is an ordinary replicated tensor and both are identities.

The model's own forward, which builds the masks and positions on every stage from ``inputs_embeds``,
is fed a stand-in of the full shape (``widen``); the received shard goes to the stage's first block.
"""

from __future__ import annotations

import math

import torch

from elixir_tune.engine.comm import is_dtensor
from elixir_tune.engine.parallel.tensor_parallel import TensorSplit
from elixir_tune.engine.parallel.tp_layout import TensorParallelError
from elixir_tune.plan import Plan


class StageBoundary:
    """How a stage's hidden states cross to the next stage (``enter``, ``leave``, ``widen``).

    Args:
        split: the model's tensor split (None: no tensor parallelism: everything is an identity).
    """

    def __init__(self, split: TensorSplit | None = None):
        self.split = split
        grid = split is not None and split.mode == "2d"
        self.grid = grid  # each rank runs its grid row's samples only
        self.sharded = split is not None and (grid or split.sequence_parallel)
        # How many ways one rank's piece divides (batch, sequence, hidden): 1d sequence shards, or the
        # 2d grid's samples over its rows and hidden features over its columns.
        q = math.isqrt(split.degree) if grid and split is not None else 1
        self.divisors = (q, 1, q) if grid else (1, split.degree if self.sharded and split is not None else 1, 1)
        self.parts = self.divisors[1]

    def _placements(self) -> tuple:
        from elixir_tune.engine.comm import Shard

        return (Shard(0), Shard(2)) if self.divisors[0] > 1 else (Shard(1),)

    def padded_length(self, longest: int) -> int:
        """The length a step's micro-batches are padded to: with sequence shards a multiple of the tensor
        degree (each tensor rank holds an equal shard of every sample's tokens)."""
        return math.ceil(longest / self.parts) * self.parts

    def sent_shape(self, batch: int, seq: int, hidden: int) -> tuple[int, int, int]:
        """The shape of the hidden states one rank sends for a micro-batch of ``batch`` x ``seq``
        (its sequence shard in 1d, its samples' hidden columns on the 2d grid)."""
        return batch // self.divisors[0], seq // self.divisors[1], hidden // self.divisors[2]

    def enter(self, hidden: torch.Tensor) -> torch.Tensor:
        """The received piece as the DTensor the stage's first block takes."""
        if not self.sharded or self.split is None:
            return hidden
        from elixir_tune.engine.comm import DTensor

        return DTensor.from_local(hidden, self.split.mesh, self._placements(), run_check=False)

    def leave(self, hidden: torch.Tensor) -> torch.Tensor:
        """The stage's last block's output as the plain tensor it sends (this rank's piece).

        Raises:
            TensorParallelError: the output is not placed as the next stage expects.
        """
        if not self.sharded:
            return hidden
        if not is_dtensor(hidden) or tuple(hidden.placements) != self._placements():
            what = f"a DTensor placed {tuple(hidden.placements)}" if is_dtensor(hidden) else "a plain tensor"
            raise TensorParallelError(
                f"a pipeline stage's output is {what}, not the {self._placements()} pieces of the residual stream "
                "that the next stage takes; set parallel.tensor.sequence_parallel: false (1d) for this model"
            )
        return hidden.to_local()

    def widen(self, hidden: torch.Tensor) -> torch.Tensor:
        """A full-shape stand-in of the received hidden states for the model's forward, which builds the
        masks and positions from its shape (its values are never read: the stage's input replaces them)."""
        if not self.sharded:
            return hidden
        full = [size * parts for size, parts in zip(hidden.shape, self.divisors, strict=True)]
        return hidden.new_zeros(()).expand(*full)


def check_combined(plan: Plan, vocab_parallel_loss: bool) -> None:
    """Refuses what a plan with both pipeline stages and tensor parallelism cannot run (``validate``
    refuses the plan-only cases first; this covers the arguments of ``setup``).

    Raises:
        TensorParallelError: says what to change.
    """
    stages, tensor = plan.parallel.pipeline.stages, plan.parallel.tensor
    if stages == 1 or tensor.degree == 1:
        return
    if vocab_parallel_loss:
        raise TensorParallelError(
            "vocab_parallel_loss with pipeline stages: the last stage computes the loss on whole logits; "
            "call setup without vocab_parallel_loss for this plan"
        )
