"""``save_pretrained`` under a pipeline plan: every stage's weights streamed to rank 0, one tensor at a time.

Each rank of a pipeline holds its stage's chunks only (engine/parallel/pipeline.py), so no rank can list
the whole model's tensors by itself. The save runs in two passes:

1. **The layout**: every rank lists its stage's tensors (name, full shape, stored dtype) and the lists
   are exchanged over the pipeline group. In stage order, a name already listed by an earlier stage is
   left to that stage, and a chunk shared by several stages (a tied embedding and head) is listed by
   the first stage using it, under that stage's name (the embedding's: the name the non-pipeline path
   writes and transformers re-ties the head to). Every rank then knows every tensor's file and offset,
   and rank 0 opens the files with their headers before any weight moves.
2. **The weights**, stage after stage: the stage's ranks gather each chunk to the first rank of their
   data group and assemble tensor-parallel pieces over their tensor group, exactly as the non-pipeline
   path (``pretrained._values``); the stage's first rank (data and tensor index 0) broadcasts each
   tensor, in the stored dtype, over world rank 0's pipeline group (the first rank of every stage),
   and rank 0 appends it to the open file. Stage 0's first rank is rank 0 itself: nothing is sent.

No rank holds more than one gathered chunk and one tensor in flight (the receiving ranks of other
stages drop each broadcast tensor at once).
"""

from __future__ import annotations

from pathlib import Path

import torch

from elixir_tune.engine.comm import gather_objects
from elixir_tune.engine.io.pretrained import _Entry, _finish, _open_writer, _split, _values, _Writer


def _stage_entries(engine, entries: list[_Entry], by_tensor: dict[int, _Entry]) -> list[_Entry]:
    """This stage's entries less the tensors of the shared chunks that an earlier stage using them writes."""
    pipeline = engine.pipeline
    left = {
        id(by_tensor[id(slot.param)])
        for chunk, _ in pipeline.shared
        if pipeline.stage != min(pipeline.layout.shared[chunk.id])
        for slot in chunk.slots
        if id(slot.param) in by_tensor
    }
    return [entry for entry in entries if id(entry) not in left]


def save_stages(
    engine,
    directory: Path,
    entries: list[_Entry],
    by_tensor: dict[int, _Entry],
    max_bytes: int,
    dtype: torch.dtype | None,
) -> None:
    """Writes a pipeline plan's weights as one Hugging Face directory on rank 0 (a collective over the world).

    Args:
        engine: this rank's chunk engine (``engine.pipeline`` set).
        directory: where rank 0 writes.
        entries: this rank's tensors in writing order (``pretrained._entries``).
        by_tensor: id of each tensor -> its entry.
        max_bytes: the largest file (a bigger tensor gets its own).
        dtype: the stored floating-point dtype (None: fp32).
    """
    pipeline = engine.pipeline
    mesh = pipeline.mesh
    mine = _stage_entries(engine, entries, by_tensor)
    listed = gather_objects(mesh.pipeline, [(e.name, e.shape, e.dtype, e.nbytes) for e in mine], all_ranks=True)
    assert listed is not None  # all_ranks: every rank gets the lists
    seen: set[str] = set()
    every: list[_Entry] = []
    per_stage: list[list[_Entry]] = []
    for stage_list in listed:
        kept = []
        for name, shape, tensor_dtype, nbytes in stage_list:
            if name not in seen:  # a module both stages hold outside the chunks: the first stage's copy
                seen.add(name)
                kept.append(_Entry(name, tuple(shape), tensor_dtype, nbytes))
        per_stage.append(kept)
        every += kept
    files = _split(every, max_bytes)
    # This stage's entries as laid out (their files), in the same order as _values yields them.
    laid_out = {entry.name: entry for entry in per_stage[pipeline.stage]}
    kept_ids = {id(entry) for entry in mine}
    local = {key: laid_out[e.name] for key, e in by_tensor.items() if id(e) in kept_ids and e.name in laid_out}
    first_of_stage = mesh.data.rank == 0 and mesh.tensor.rank == 0  # world rank 0's pipeline group
    writer: _Writer | None = _open_writer(directory, every, files) if mesh.world.rank == 0 else None
    try:
        for stage, stage_entries in enumerate(per_stage):
            if stage == pipeline.stage:
                expected = iter(stage_entries)
                for entry, value in _values(engine, local):
                    if next(expected, None) is not entry:  # rank 0 reads them in this order: a bug, not a user error
                        raise RuntimeError(f"save_pretrained: stage {stage} sends {entry.name} out of order")
                    if writer is not None:  # stage 0: rank 0 holds it
                        writer.write(entry, value)
                    elif first_of_stage:
                        _send(mesh.pipeline, entry, value, stage)
            elif first_of_stage and stage > 0:
                for entry in stage_entries:
                    value = _receive(mesh.pipeline, entry, stage)
                    if writer is not None:
                        writer.write(entry, value)
    finally:
        if writer is not None:
            writer.close()
    if writer is not None:
        _finish(engine, directory, writer, dtype)
    mesh.world.barrier()  # nobody reads the directory before it is complete


def _send(comm, entry: _Entry, value: torch.Tensor, stage: int) -> None:
    """Broadcasts one tensor's bytes (in its stored dtype) from this stage's first rank."""
    if entry.nbytes:
        data = value.detach().to(entry.dtype).contiguous().reshape(-1).view(torch.uint8)
        comm.broadcast(data.to(comm.device), src=stage)


def _receive(comm, entry: _Entry, stage: int) -> torch.Tensor:
    """One tensor broadcast by ``stage``'s first rank, at its shape and stored dtype, on the CPU."""
    data = torch.empty(entry.nbytes, dtype=torch.uint8, device=comm.device)
    if entry.nbytes:
        comm.broadcast(data, src=stage)
    return data.cpu().view(entry.dtype).view(entry.shape)
