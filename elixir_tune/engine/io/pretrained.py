"""Weights out in Hugging Face layout: ``save_pretrained(model, DIR)``, streamed chunk by chunk.

Rank 0 writes safetensors files itself: every tensor's name, dtype and shape are known before any
weight is gathered, so the file split and each file's header are decided first, and then each
chunk, gathered to rank 0 alone, is cut into its parameters and appended to the open file. No rank
holds more than one gathered chunk (plus one frozen tensor or buffer) at a time. Several files get
``model-0000i-of-0000n.safetensors`` names and ``model.safetensors.index.json``, one file is
``model.safetensors``, as transformers writes them; ``config.json`` and ``generation_config.json``
come from the model's ``config`` / ``generation_config`` when it has them.

Under a tensor-parallel plan a chunk holds each tensor rank's pieces: the chunk is gathered to the
first rank of each data-parallel group (the ranks of world rank 0's tensor group), which then
assemble each parameter from their pieces over the tensor group (``TensorSplit.full_state``) for
rank 0 to write at its full shape. Rank 0 then holds one gathered chunk and one full parameter at
a time.

Under a pipeline plan (``save_stages``) every stage's weights are streamed to rank 0, one tensor at a
time. Each rank of a pipeline holds its stage's chunks only (engine/parallel/pipeline.py), so no rank
can list the whole model's tensors by itself. The save runs in two passes:

1. **The layout**: every rank lists its stage's tensors (name, full shape, stored dtype) and the lists
   are exchanged over the pipeline group. In stage order, a name already listed by an earlier stage is
   left to that stage, and a chunk shared by several stages (a tied embedding and head) is listed by
   the first stage using it, under that stage's name (the embedding's: the name the non-pipeline path
   writes and transformers re-ties the head to). Every rank then knows every tensor's file and offset,
   and rank 0 opens the files with their headers before any weight moves.
2. **The weights**, stage after stage: the stage's ranks gather each chunk to the first rank of their
   data group and assemble tensor-parallel pieces over their tensor group, exactly as the non-pipeline
   path (``_values``); the stage's first rank (data and tensor index 0) broadcasts each
   tensor, in the stored dtype, over world rank 0's pipeline group (the first rank of every stage),
   and rank 0 appends it to the open file. Stage 0's first rank is rank 0 itself: nothing is sent.

No rank holds more than one gathered chunk and one tensor in flight (the receiving ranks of other
stages drop each broadcast tensor at once).

A failure on rank 0 never leaves the other ranks in a collective. Rank 0 writes into a staging
directory inside DIR and renames the complete files into place (``pretrained_files.py``); a write
that fails there is recorded, and the stream goes on without writing, so that every rank reaches
the end. Twice the ranks exchange rank 0's status (``shared_errors``): after rank 0 has created the
directories, before any weight moves (a path that is not a directory, no permission), and at the
end, in place of a barrier (a full disk mid-file). On a failure every rank raises the same
:class:`SaveError`, and DIR keeps the files of the previous save.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from elixir_tune.engine.comm import Comm, gather_objects, shared_errors
from elixir_tune.engine.io.pretrained_files import ExportDir, SaveError, Writer
from elixir_tune.engine.io.weights import INDEX_NAME
from elixir_tune.engine.parallel.tensor_parallel import local_data

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5e9 bytes (KB/MB/GB decimal, KiB/MiB/GiB binary, as transformers reads them)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]I?B|B)?\s*", str(size).upper())
    if not match:
        raise ValueError(f"max_shard_size {size!r}: expected bytes or a size such as '5GB' or '500MiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


@dataclass
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    file: int = 0


def _entries(engine, dtype: torch.dtype | None) -> tuple[list[_Entry], dict[int, _Entry]]:
    """One entry per tensor in writing order: chunk slots in chunk order, then the replicated tensors.

    A tied weight is written once, under its first state-dict name (transformers re-ties the others).
    """
    first_name: dict[int, str] = {}
    values: dict[int, torch.Tensor] = {}
    for name, value in engine.model.state_dict(keep_vars=True).items():
        first_name.setdefault(id(value), name)
        values[id(value)] = value
    entries, by_tensor = [], {}

    def add(key: int, shape, tensor_dtype: torch.dtype) -> None:
        out = dtype if (dtype is not None and tensor_dtype.is_floating_point) else tensor_dtype
        numel = 1
        for dim in shape:
            numel *= dim
        entry = _Entry(first_name[key], tuple(shape), out, numel * out.itemsize)
        entries.append(entry)
        by_tensor[key] = entry

    for chunk in engine.chunks:
        for slot in chunk.slots:
            if id(slot.param) in first_name and id(slot.param) not in by_tensor:
                shape = list(slot.param.shape)  # the full shape (a DTensor's is global)
                if engine.experts is not None and id(slot.param) in engine.experts.param_slices:
                    shape[0] *= engine.experts.degree  # this rank holds 1/E of the experts
                add(id(slot.param), shape, torch.float32)
    for key, value in values.items():
        if key not in by_tensor:
            add(key, value.shape, torch.float32 if isinstance(value, torch.nn.Parameter) else value.dtype)
    return entries, by_tensor


def _split(entries: list[_Entry], max_bytes: int) -> int:
    """Assigns consecutive entries to files of at most ``max_bytes`` (a bigger tensor alone); returns the count."""
    file, used = 0, 0
    for entry in entries:
        if used and used + entry.nbytes > max_bytes:
            file, used = file + 1, 0
        entry.file = file
        used += entry.nbytes
    return file + 1 if entries else 0


@torch.no_grad()
def save_pretrained(
    model, directory: str | os.PathLike, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None
) -> Path:
    """Writes the model's current weights as a Hugging Face model directory (a collective).

    ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` loads it, and so does
    ``elixir_tune.setup(..., weights=directory)``.

    Args:
        model: the ElixirModel from ``elixir_tune.setup``.
        directory: created if needed; earlier ``model*.safetensors`` files and index there are replaced
            once the new files are complete (other files there are left alone).
        max_shard_size: the largest file (bytes or a size such as ``"5GB"``); a bigger tensor gets its own.
        dtype: floating-point dtype to store (default fp32, the master weights).

    Returns:
        The directory.

    Raises:
        SaveError: on every rank, when rank 0 could not write (a path that is not a directory, no
            permission, a full disk): the message names the rank, the file and the cause, and
            ``directory`` holds what it held before.

    Under a pipeline plan rank 0 writes every stage's tensors, each streamed to it from the first rank of
    its stage (``save_stages``); a tied weight whose stages differ (an embedding and its head)
    is written once, under the first stage's name, as without a pipeline.
    """
    engine = model.engine
    model.check_finite()  # NonFiniteError before anything is written (engine/finite.py)
    directory = Path(directory)
    world = engine.mesh.world
    entries, by_tensor = _entries(engine, dtype)
    # World rank 0 alone writes: under tensor parallelism every tensor rank of data index 0 is its data group's rank 0.
    export = ExportDir(directory, world.rank) if world.rank == 0 else None
    if export is not None:
        export.prepare()
    _agree(world, export, directory)  # a bad path fails on every rank before any weight moves
    if engine.pipeline is not None:
        save_stages(engine, export, entries, by_tensor, parse_size(max_shard_size), dtype)
    else:
        files = _split(entries, parse_size(max_shard_size))
        writer = Writer(export, entries, files) if export is not None else None
        try:
            for entry, value in _values(engine, by_tensor):
                if writer is not None:
                    writer.write(entry, value)
        finally:
            if writer is not None:
                writer.close()
        if writer is not None:
            _finish(engine, writer, dtype)
    _agree(world, export, directory)  # nobody returns before the directory is complete, or all raise
    return directory


def _agree(world: Comm, export: ExportDir | None, directory: Path) -> None:
    """Every rank learns whether the writing rank failed; if it did, all raise the same SaveError.

    The writing rank removes its staging files first, so that no rank returns while they are there.
    """
    if export is not None and export.error is not None:
        export.abort()
    errors = shared_errors(world, export.error if export is not None else None)
    if errors:
        if export is not None:
            export.abort()
        raise SaveError(f"save_pretrained: {'; '.join(errors)}")


def _finish(engine, writer: Writer, dtype: torch.dtype | None) -> None:
    """Rank 0, after the last tensor: the index (several files) and the configs, then every file into place."""
    export = writer.export
    if writer.files > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in writer.entries)},
            "weight_map": {e.name: writer.names[e.file] for e in writer.entries},
        }
        export.write_text(INDEX_NAME, json.dumps(index, indent=2, sort_keys=True))
    export.save_configs(engine.model, dtype or torch.float32)
    export.publish()


def _values(engine, by_tensor: dict[int, _Entry]) -> Iterator[tuple[_Entry, torch.Tensor]]:
    """This rank's tensors at their full shapes, one at a time, in ``_entries``' order (a collective over
    the data group, and over the tensor group for split ones): on the first rank of the data group (each
    tensor rank of it gets the full value); the other ranks get nothing."""
    split = engine.tensor_parallel

    def whole(entry: _Entry, param: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
        """The full value from this rank's piece (a collective over the tensor group when split, over
        the expert group for experts: every rank gets an expert chunk, EngineState.gathered_chunks)."""
        if engine.experts is not None and id(param) in engine.experts.param_slices:
            return engine.experts.gather(param, piece)
        if split is None:
            return piece
        return split.full_state({entry.name: piece}, {entry.name: param})[entry.name]

    for chunk, flat in engine.state.gathered_chunks(all_ranks=False):
        if flat is None:  # not the first rank of its data group: its tensor group does not write
            continue
        for slot in chunk.slots:
            entry = by_tensor.get(id(slot.param))
            if entry is not None:
                yield entry, whole(entry, slot.param, flat[slot.offset : slot.offset + slot.numel].view(slot.shape))
    if engine.comm.rank == 0:
        chunked = {id(slot.param) for slot in engine.slots}
        for name, value in engine.model.state_dict(keep_vars=True).items():
            entry = by_tensor.get(id(value))
            if id(value) not in chunked and entry is not None and entry.name == name:
                yield entry, whole(entry, value, local_data(value).detach().cpu())


# --- a pipeline plan's stages ---------------------------------------------------------------------


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
    export: ExportDir | None,
    entries: list[_Entry],
    by_tensor: dict[int, _Entry],
    max_bytes: int,
    dtype: torch.dtype | None,
) -> None:
    """Streams a pipeline plan's weights into rank 0's files (a collective over the world; ``save_pretrained``
    then puts them in place and makes the ranks agree on the outcome).

    Args:
        engine: this rank's chunk engine (``engine.pipeline`` set).
        export: the save's target on rank 0 (its staging directory, its first failure); None elsewhere.
        entries: this rank's tensors in writing order (``_entries``).
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
    writer = Writer(export, every, files) if export is not None else None
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
        _finish(engine, writer, dtype)


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
