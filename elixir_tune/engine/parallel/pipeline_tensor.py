"""Pipeline stages whose modules are tensor-parallel: what crosses a stage boundary.

With pipeline P and tensor T in one plan (world = data x P x T, ``engine/comm.py``'s ``Mesh``), the
model is first split over its tensor group (``tensor_parallel.py``) and then cut into stages
(``pipeline_stages.py``): each rank runs its stage's modules on its tensor-parallel pieces. Stage s at
tensor index t sends to stage s + 1 at the same tensor index, so the T ranks of a stage each hand
their own copy to their own peer (the pipeline group is ``(data, *, tensor)``).

What crosses is the residual stream as an ordinary, replicated tensor of the full shape
``(batch, seq, hidden)``, so torch's ``PipelineStage`` (static shapes, plain tensors) carries it as
it does without tensor parallelism. Between tensor-parallel blocks the stream has the layout of the
embedding's output: with sequence parallelism a DTensor sharded on the sequence dimension, so a
stage all-gathers it over its tensor group when it leaves (``leave``) and the next stage takes its
own sequence shard when it enters (``enter``, no traffic); without sequence parallelism it is
already a replicated plain tensor and both are identities. The gradients go back the same way: the
gradient of the entered shard is all-gathered (each rank sends its peer the full, equal gradient)
and the received one is cut to the shard the leaving stage's ranks held.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from elixir_tune.engine.comm import is_dtensor
from elixir_tune.engine.parallel.tensor_parallel import TensorSplit
from elixir_tune.engine.parallel.tp_layout import TensorParallelError
from elixir_tune.plan import Plan

Boundary = Callable[[torch.Tensor], torch.Tensor]


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def stage_boundaries(split: TensorSplit | None) -> tuple[Boundary, Boundary]:
    """(enter, leave): how a stage turns the received replicated hidden states into the layout its
    first block takes, and its last block's output into the replicated tensor it sends.

    Args:
        split: the model's tensor split (None: no tensor parallelism).
    """
    if split is None or not split.sequence_parallel:
        return _identity, _identity
    from elixir_tune.engine.comm import DTensor, Replicate, Shard

    mesh = split.mesh

    def enter(hidden: torch.Tensor) -> torch.Tensor:
        whole = DTensor.from_local(hidden, mesh, (Replicate(),), run_check=False)
        return whole.redistribute(mesh, (Shard(1),))

    def leave(hidden: torch.Tensor) -> torch.Tensor:
        return hidden.full_tensor() if is_dtensor(hidden) else hidden

    return enter, leave


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


def padded_length(longest: int, split: TensorSplit | None) -> int:
    """The length a step's micro-batches are padded to: with sequence parallelism a multiple of the
    tensor degree (each tensor rank holds an equal shard of every sample's tokens)."""
    if split is None or not split.sequence_parallel:
        return longest
    return math.ceil(longest / split.degree) * split.degree
