"""Sharded checkpoints: every rank saves its own master shards and optimizer state; resume is exact.

A checkpoint is a directory:

    meta.json         plan fingerprint and layout, world size, chunk size, dtype, step, extra, torch version
    rank-00000.pt     rank 0's fp32 master shards, optimizer state (step counts included), loss scaler,
    rank-00001.pt     skipped steps, replicated tensors (frozen parameters, buffers) and RNG state
    model.pt          the full fp32 state dict with the original names (rank 0), for plain-model loading

It is written to a hidden sibling directory first and renamed into place by rank 0 after a barrier,
with ``meta.json`` written last: an interrupted save leaves no directory that looks complete.
Ranks must see the same filesystem (the usual shared checkpoint directory).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from elixir_tune.engine.tensor_parallel import refuse_tensor_parallel
from elixir_tune.plan import Plan

FORMAT_VERSION = 1
META_NAME = "meta.json"
MODEL_NAME = "model.pt"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def plan_layout(plan: Plan) -> str:
    """Hash of what decides each rank's shard contents: world size, chunk size, chunk packing, offload.

    Offload matters too: device and host shards get separate inner optimizers, whose state_dict
    order depends on the split.
    """
    layout = {
        "world_size": plan.world_size,
        "chunk_size": plan.memory.chunk_size,
        "chunks": [[chunk.id, list(chunk.params), bool(chunk.offload)] for chunk in plan.memory.chunks],
    }
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]


def _to_cpu(obj):
    """A copy of ``obj`` with every tensor on the CPU (files load on any device)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {key: _to_cpu(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(value) for value in obj)
    return obj


def _load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001  (a user's param group may hold a non-primitive value)
        # Our own file format, written by save_checkpoint: full unpickling is what it needs then.
        return torch.load(path, map_location="cpu", weights_only=False)


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    if state.get("cpu") is not None:
        torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def _replicated(engine) -> dict[str, torch.Tensor]:
    """State-dict entries that are not in chunks (frozen parameters, buffers): the same on every rank."""
    return {
        name: value.detach().cpu().clone()
        for name, value in engine.model.state_dict(keep_vars=True).items()
        if id(value) not in engine.slot_of
    }


@torch.no_grad()
def save_checkpoint(path: str | os.PathLike, model, optimizer, step: int, extra: dict | None = None) -> Path:
    """Saves a sharded checkpoint (a collective: every rank calls it with the same ``path``).

    Args:
        path: the checkpoint directory; an existing one is replaced (only once the new one is complete).
        model: the ElixirModel from ``elixir_tune.setup``.
        optimizer: its ShardedOptimizer.
        step: optimizer steps done (training resumes at this step).
        extra: JSON-serialisable data kept in meta.json (e.g. the LR schedule's settings).

    Returns:
        The checkpoint directory.
    """
    engine = model.engine
    model.check_finite()  # a NaN step never overwrites a good checkpoint (NonFiniteError; engine/finite.py)
    refuse_tensor_parallel(engine, "save_checkpoint")  # not yet tested with tensor-parallel pieces
    comm, plan = _world_and_plan(engine)
    final = Path(path).absolute()
    tmp = final.parent / f".{final.name}.tmp"
    full = model.state_dict()  # collective: rank 0 gathers the full weights (the others get {}) and writes them
    if comm.rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # a save that was interrupted earlier
        tmp.mkdir(parents=True)
    comm.barrier()
    shard = {
        "format": FORMAT_VERSION,
        "rank": comm.rank,
        "world_size": comm.world_size,
        "masters": [chunk.master.detach().cpu().clone() for chunk in engine.chunks],
        "optimizer": _to_cpu(optimizer.state_dict()),
        "skipped_steps": int(optimizer.skipped_steps),
        "replicated": _replicated(engine),
        "rng": _rng_state(engine.device),
    }
    torch.save(shard, tmp / rank_file_name(comm.rank))
    if comm.rank == 0:
        torch.save(full, tmp / MODEL_NAME)
    comm.barrier()  # every rank file is on disk
    if comm.rank == 0:
        meta = {
            "format": FORMAT_VERSION,
            "fingerprint": plan.model.fingerprint,
            "layout": plan_layout(plan),
            "world_size": comm.world_size,
            "chunk_size": plan.memory.chunk_size,
            "dtype": plan.training.dtype,
            "optimizer": optimizer.optimizer_class.__name__,
            "step": int(step),
            "extra": extra or {},
            "torch_version": torch.__version__,
        }
        (tmp / META_NAME).write_text(json.dumps(meta, indent=1))  # last: marks the directory complete
        old = final.parent / f".{final.name}.old"
        if old.exists():
            shutil.rmtree(old)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            shutil.rmtree(old)
    comm.barrier()  # nobody returns before the checkpoint is in place
    return final


def read_meta(path: str | os.PathLike) -> dict:
    """The ``meta.json`` of a checkpoint directory.

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
    """
    meta_path = Path(path) / META_NAME
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} is not a complete elixir-tune checkpoint (no {META_NAME})")
    return json.loads(meta_path.read_text())


@torch.no_grad()
def load_checkpoint(path: str | os.PathLike, model, optimizer) -> dict:
    """Restores a checkpoint saved by :func:`save_checkpoint` (every rank calls it).

    The same plan layout (world size, chunk size, chunk packing) restores this rank's shards,
    optimizer state, loss scaler, skipped steps and RNG state exactly: training continues bitwise as
    if never stopped. Another layout restores only the weights (from ``model.pt``) and warns that
    the optimizer state starts afresh.

    Args:
        path: the checkpoint directory.
        model: the ElixirModel from ``elixir_tune.setup``.
        optimizer: its ShardedOptimizer.

    Returns:
        The checkpoint's meta (``step``, ``extra``, ``world_size``, ...), plus ``exact``: whether
        optimizer state was restored.

    Raises:
        FileNotFoundError: not a complete checkpoint.
        ValueError: the checkpoint belongs to another model (fingerprint differs).
    """
    engine = model.engine
    comm, plan = _world_and_plan(engine)
    directory = _complete_directory(Path(path))
    meta = read_meta(directory)
    if meta.get("fingerprint") != plan.model.fingerprint:
        raise ValueError(
            f"checkpoint {directory} was saved for another model: its fingerprint is {meta.get('fingerprint')}, "
            f"this model's plan has {plan.model.fingerprint} (parameter names, shapes or dtypes differ)"
        )
    optimizer.steps_done = int(meta.get("step", 0))  # a NonFiniteError names steps as the whole run counts them
    same_layout = meta.get("layout") == plan_layout(plan) and meta.get("world_size") == comm.world_size
    same_optimizer = meta.get("optimizer") == optimizer.optimizer_class.__name__
    if same_layout and same_optimizer:
        _load_shards(directory, engine, optimizer)
        meta["exact"] = True
        return meta
    why = (
        f"it was saved with world size {meta.get('world_size')} and chunk size {meta.get('chunk_size')}, "
        f"this run has {comm.world_size} and {plan.memory.chunk_size}"
        if not same_layout
        else f"it was saved with {meta.get('optimizer')}, this run uses {optimizer.optimizer_class.__name__}"
    )
    warnings.warn(
        f"checkpoint {directory}: {why}; loading the weights only (model.pt): the optimizer state "
        "(moments, step counts, loss scale) could NOT be restored and starts afresh",
        stacklevel=2,
    )
    model.load_state_dict(_load(directory / MODEL_NAME))
    meta["exact"] = False
    return meta


def _complete_directory(directory: Path) -> Path:
    """``directory``, or, when a save died between its two renames, the complete copy it left beside it."""
    if (directory / META_NAME).is_file():
        return directory
    # meta.json is written after every rank file: a directory holding it is complete. The new copy
    # (.tmp) wins over the one it was replacing (.old).
    for suffix in ("tmp", "old"):
        sibling = directory.parent / f".{directory.name}.{suffix}"
        if (sibling / META_NAME).is_file():
            warnings.warn(
                f"{directory} is missing (a save was interrupted while renaming): using {sibling}", stacklevel=3
            )
            return sibling
    return directory


def _world_and_plan(engine):
    """Every rank of the run and the whole plan: a pipeline rank's engine holds its stage's chunks
    only (``engine.plan``), but files are named by global rank and the layout is the whole plan's."""
    pipeline = engine.pipeline
    return engine.mesh.world, pipeline.full_plan if pipeline is not None else engine.plan


def _load_shards(directory: Path, engine, optimizer) -> None:
    rank = engine.mesh.world.rank
    shard = _load(directory / rank_file_name(rank))
    masters = shard["masters"]
    if len(masters) != len(engine.chunks) or any(
        m.shape != c.master.shape for m, c in zip(masters, engine.chunks, strict=True)
    ):
        raise ValueError(f"{directory / rank_file_name(rank)} does not match this plan's chunks")
    engine.cache.wait_all()  # no gather in flight may read a master while it is written
    for chunk, master in zip(engine.chunks, masters, strict=True):
        chunk.init_master(master)
    optimizer.load_state_dict(shard["optimizer"])
    optimizer.skipped_steps = int(shard.get("skipped_steps", 0))
    state = engine.model.state_dict(keep_vars=True)
    for name, value in shard.get("replicated", {}).items():
        if name in state and id(state[name]) not in engine.slot_of:
            state[name].data.copy_(value)
    _set_rng_state(shard.get("rng", {}), engine.device)
    optimizer.zero_grad()
    engine.after_step()  # drop gathered copies of the old weights, regather resident chunks
