"""Pipeline stages whose modules are tensor-parallel: what crosses a stage boundary.

With pipeline P and tensor T in one plan (world = data x P x T, ``engine/comm.py``'s ``Mesh``), the
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
* without it the stream is an ordinary replicated tensor and both are identities.

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
        self.sharded = split is not None and split.mode == "1d" and split.sequence_parallel
        self.parts = split.degree if self.sharded and split is not None else 1

    def padded_length(self, longest: int) -> int:
        """The length a step's micro-batches are padded to: with sequence shards a multiple of the tensor
        degree (each tensor rank holds an equal shard of every sample's tokens)."""
        return math.ceil(longest / self.parts) * self.parts

    def sent_length(self, seq: int) -> int:
        """Tokens per sample that one rank sends (its sequence shard)."""
        return seq // self.parts

    def enter(self, hidden: torch.Tensor) -> torch.Tensor:
        """The received shard as the DTensor the stage's first block takes."""
        if not self.sharded or self.split is None:
            return hidden
        from elixir_tune.engine.comm import DTensor, Shard

        return DTensor.from_local(hidden, self.split.mesh, (Shard(1),), run_check=False)

    def leave(self, hidden: torch.Tensor) -> torch.Tensor:
        """The stage's last block's output as the plain tensor it sends (this rank's shard).

        Raises:
            TensorParallelError: the output is not sequence-sharded as the next stage expects.
        """
        if not self.sharded:
            return hidden
        from elixir_tune.engine.comm import Shard

        if not is_dtensor(hidden) or tuple(hidden.placements) != (Shard(1),):
            what = f"a DTensor placed {tuple(hidden.placements)}" if is_dtensor(hidden) else "a plain tensor"
            raise TensorParallelError(
                f"a pipeline stage's output is {what}, not the sequence shards of the residual stream that "
                "the next stage takes; set parallel.tensor.sequence_parallel: false for this model"
            )
        return hidden.to_local()

    def widen(self, hidden: torch.Tensor) -> torch.Tensor:
        """A full-shape stand-in of the received hidden states for the model's forward, which builds the
        masks and positions from its shape (its values are never read: the stage's input replaces them)."""
        if not self.sharded:
            return hidden
        batch, seq, width = hidden.shape
        return hidden.new_zeros(()).expand(batch, seq * self.parts, width)


def check_combined(plan: Plan, vocab_parallel_loss: bool) -> None:
    """Refuses what a plan with both pipeline stages and tensor parallelism cannot run (``validate``
    refuses the plan-only cases first; this covers the arguments of ``setup``).

    Raises:
        TensorParallelError: says what to change.
    """
    stages, tensor = plan.parallel.pipeline.stages, plan.parallel.tensor
    if stages == 1 or tensor.degree == 1:
        return
    if tensor.mode == "2d":
        raise TensorParallelError(
            f"pipeline stages {stages} with 2d tensor parallelism: stages pass whole micro-batches and the 2d grid "
            "splits them by rows; use parallel.tensor.mode 1d with a pipeline"
        )
    if vocab_parallel_loss:
        raise TensorParallelError(
            "vocab_parallel_loss with pipeline stages: the last stage computes the loss on whole logits; "
            "call setup without vocab_parallel_loss for this plan"
        )
