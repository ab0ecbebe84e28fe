"""The data contract, checked at the first step: ranks that share a data-parallel index get the same
micro-batches.

A tensor-parallel group computes one model replica together and a pipeline passes one set of
micro-batches from stage to stage, so every rank of such a group must be fed the same data: the
slice of data index ``rank // (P x T)`` (``elixir_tune.data_rank()``), of ``world / (P x T)``
slices (``elixir_tune.data_size()``). A script that slices by RANK / WORLD_SIZE instead gives the
ranks of one group different inputs (or an empty one): a crash, or silently wrong gradients.

The first call of ``forward_backward`` (or of ``model(...)``) compares a fingerprint of its inputs
over the world (one object all-gather, once; nothing after) and every rank raises the same
``ContractError`` if two ranks of one data index differ. The fingerprint is cheap: each tensor's
shape and dtype, the float64 sum of its values and of its values weighted by their position (so
a reordering shows too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from elixir_tune.engine.comm import Mesh, gather_objects
from elixir_tune.errors import ContractError


def _tensor_print(value: torch.Tensor) -> tuple:
    flat = value.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    sums = torch.stack([flat.sum(), (flat * weights).sum()]) if flat.numel() else torch.zeros(2, dtype=torch.float64)
    return (tuple(value.shape), str(value.dtype).removeprefix("torch."), *sums.cpu().tolist())


def input_fingerprint(micro_batches: Sequence[Any]) -> list[tuple]:
    """Per micro-batch (a dict of keyword arguments, or a tuple of positional ones), per tensor in it:
    (key, shape, dtype, sum, position-weighted sum); other values by their repr."""
    result = []
    for batch in micro_batches:
        items = sorted(batch.items()) if isinstance(batch, dict) else list(enumerate(batch))
        result.append(
            tuple(
                (str(key), *_tensor_print(value)) if isinstance(value, torch.Tensor) else (str(key), repr(value))
                for key, value in items
            )
        )
    return result


def _summary(fingerprint: list[tuple]) -> str:
    """What a rank was fed, in words: micro-batch count and the first one's tensor shapes."""
    if not fingerprint:
        return "no micro-batches"
    shapes = ", ".join(f"{item[0]} {list(item[1])}" for item in fingerprint[0] if isinstance(item[1], tuple))
    return f"{len(fingerprint)} micro-batch(es), the first with {shapes or 'no tensors'}"


def check_shared_inputs(mesh: Mesh, micro_batches: Sequence[Any]) -> None:
    """Raises on every rank if ranks of one data index were fed different micro-batches (a collective
    over the world; call it once, at the first step, on every rank).

    Args:
        mesh: the run's process groups.
        micro_batches: this rank's inputs of the step.

    Raises:
        ContractError: names the ranks whose inputs differ and how to slice the data.
    """
    shared = mesh.pipeline.world_size * mesh.tensor.world_size
    if shared == 1:
        return  # every rank has its own data index: nothing to compare
    mine = (mesh.data_rank, input_fingerprint(micro_batches))
    everyone = gather_objects(mesh.world, mine, all_ranks=True)
    assert everyone is not None  # all_ranks
    first_of: dict[int, int] = {}
    problems = []
    for rank, (data_index, fingerprint) in enumerate(everyone):
        first = first_of.setdefault(data_index, rank)
        if fingerprint != everyone[first][1]:
            problems.append(
                f"rank {rank} was fed other micro-batches than rank {first} (both data index {data_index}; "
                f"rank {first}: {_summary(everyone[first][1])}; rank {rank}: {_summary(fingerprint)})"
            )
    if problems:
        data_size = mesh.world.world_size // shared
        raise ContractError(
            f"the ranks of one data-parallel index (its {mesh.pipeline.world_size} pipeline stage(s) x "
            f"{mesh.tensor.world_size} tensor rank(s)) must be fed the same micro-batches, but at the first step "
            + "; ".join(problems[:4])
            + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
            + ". Take each rank's slice of the global batch with elixir_tune.data_rank() and "
            f"elixir_tune.data_size() (the data-parallel index and degree: {data_size} here), not RANK and WORLD_SIZE"
        )


def batch_shape_note(micro_batches: Sequence[Any], micro_batch_size: int, seq_len: int) -> str | None:
    """A note when the first step's micro-batch is not the plan's (samples x tokens of ``input_ids``).

    The plan's predictions (step time, peak memory) were made for its own micro-batch; a script that
    feeds another still trains right, but the figures ``elixir-run`` announced do not apply to it.

    Returns:
        The note, or None when the shapes agree or there is no ``input_ids`` to read.
    """
    batch = micro_batches[0] if micro_batches else None
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    samples, tokens = ids.shape
    if (samples, tokens) == (micro_batch_size, seq_len):
        return None
    risk = "its peak memory may exceed the prediction" if samples * tokens > micro_batch_size * seq_len else ""
    return (
        f"this script's micro-batch is {samples} x {tokens} tokens, the plan's {micro_batch_size} x {seq_len}: "
        f"the plan's step time and memory were predicted for its own{'; ' + risk if risk else ''}. For a plan "
        f"of this script, search with --fix micro_batch_size={samples} (profiled at seq_len {tokens})"
    )
