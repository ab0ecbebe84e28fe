"""Sharded checkpoints: every rank saves its own master shards and optimizer state; resume is exact.

``save_checkpoint(root, ...)`` writes one checkpoint directory ``root/step-NNNNNN/``, points
``root/latest`` at it and keeps the newest ``keep`` of them (``checkpoint_files.py`` has the layout):

    meta.json         plan fingerprint and layout, world size, chunk size, dtype, step, extra, torch
                      version, and each file's size and sha256
    rank-00000.pt     rank 0's fp32 master shards, optimizer state (step counts included), loss scaler,
    rank-00001.pt     skipped steps, replicated tensors (frozen parameters, buffers) and RNG state
    model.pt          the full fp32 state dict with the original names (rank 0), for plain-model loading

What a save promises: it is refused, before anything is written, when this process cannot own the
root (another live job holds its lock), when a rank's weights or optimizer state are not finite, or
when the filesystem has less free space than the checkpoint needs; the files go to a hidden
``.step-NNNNNN.tmp`` first, renamed into place by rank 0 with ``meta.json`` written last, and a failed
write removes it: the previous checkpoints are never touched by a save that fails. Loading uses
``torch.load(weights_only=True)`` only (nothing in a file can run) and checks every file of the
checkpoint against meta.json before any loads. The ranks agree on every outcome before any of them raises: each raises the same
one-line :class:`CheckpointError`, none waits in a collective for a rank that gave up. Ranks must
see the same filesystem (the usual shared checkpoint directory).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from elixir_tune.engine.comm import Comm, gather_objects, shared_errors
from elixir_tune.engine.io import checkpoint_files as files
from elixir_tune.engine.io.checkpoint_files import META_NAME, MODEL_NAME, CheckpointError, rank_file_name
from elixir_tune.plan import Plan

# 3: meta.json also carries its own sha256 (an edited step or fingerprint is refused); 2: each file's size and
# sha256 (still loaded: its metadata is only type-checked); 1: no checksums (still loaded, with a note).
FORMAT_VERSION = files.META_CHECKSUM_FORMAT
DEFAULT_KEEP = 2


def plan_layout(plan: Plan) -> str:
    """Hash of what decides each rank's shard contents: world size, chunk size, chunk packing, offload,
    and the tensor split.

    Offload matters too: device and host shards get separate inner optimizers, whose state_dict
    order depends on the split. Under tensor parallelism the chunks hold each tensor rank's pieces,
    so the tensor degree and mode are part of the layout (left out at degree 1: a data-parallel
    plan's hash is what it was before tensor plans could save).
    """
    layout: dict = {
        "world_size": plan.world_size,
        "chunk_size": plan.memory.chunk_size,
        "chunks": [[chunk.id, list(chunk.params), bool(chunk.offload)] for chunk in plan.memory.chunks],
    }
    tensor = plan.parallel.tensor
    if tensor.degree > 1:
        layout["tensor"] = [tensor.degree, tensor.mode]
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


def _agree(comm: Comm, error: str | None, prefix: str = "", advice: str = "") -> None:
    """Every rank learns every rank's error; when there is one, all raise the same CheckpointError
    (``prefix``, the errors, then ``advice``: what to do).

    A rank that raised alone would leave the others waiting in their next collective (gloo then
    reports "Connection closed" on a rank that did nothing wrong).
    """
    distinct = shared_errors(comm, error)
    if distinct:
        raise CheckpointError(prefix + "; ".join(distinct) + (f"; {advice}" if advice else ""))


def _note(comm: Comm, notes: list[str]) -> None:
    """Warns once per job (rank 0): every rank found the same, or only rank 0 looked."""
    if comm.rank == 0:
        for note in notes:
            warnings.warn(f"checkpoint: {note}", stacklevel=3)


def lock_checkpoint_dir(path: str | os.PathLike, model) -> None:
    """Makes this job the only writer of the checkpoint root ``path`` until it ends (a collective).

    save_checkpoint takes the lock too; a training script calls this at start so that a second job
    is refused before it trains rather than at its first save.

    Raises:
        CheckpointError: another live job holds the lock (on every rank; names its host, pid, start time).
    """
    comm, _ = _world_and_plan(model.engine)
    root = Path(path).absolute()
    notes, error = [], None
    if comm.rank == 0:
        try:
            notes = files.acquire_lock(root)
        except CheckpointError as failure:
            error = f"rank 0: {failure}"  # the writing rank names itself, as a failed write does
        except OSError as failure:  # a full disk or a read-only place: every rank gets this line, none a traceback
            error = (
                f"rank 0: cannot write checkpoints to {root}: {' '.join(str(failure).split())} (free on that "
                f"filesystem: {_free_text(root if root.exists() else root.parent)}); free space or give another --save"
            )
    _agree(comm, error)
    _note(comm, notes)


def _non_finite(engine, optimizer) -> str | None:
    """What in this rank's shards is NaN or infinite (its first such tensor), or None."""
    for chunk in engine.chunks:
        if not bool(torch.isfinite(chunk.master).all()):
            return f"the weights of chunk {chunk.id}"
    for inner, _ in getattr(optimizer, "_inner", []):
        for state in inner.state.values():
            for name, value in state.items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.is_floating_point()
                    and not bool(torch.isfinite(value).all())
                ):
                    return f"the optimizer's {name!r}"
    return None


def save_checkpoint(
    path: str | os.PathLike,
    model,
    optimizer,
    step: int,
    extra: dict | None = None,
    keep: int | None = DEFAULT_KEEP,
) -> Path:
    """Saves a sharded checkpoint as ``path/step-NNNNNN`` (a collective: every rank calls it with the same ``path``).

    Args:
        path: the checkpoint root; created if missing; this job becomes its only writer.
        model: the ElixirModel from ``elixir_tune.setup``.
        optimizer: its ShardedOptimizer.
        step: optimizer steps done (training resumes at this step); names the directory.
        extra: JSON-serialisable data kept in meta.json (e.g. the LR schedule's settings).
        keep: how many checkpoints to keep in ``path``, this one included (None: all).

    Returns:
        The new checkpoint's directory.

    Raises:
        CheckpointError: on every rank, with nothing replaced: another job owns ``path``, a rank's
            weights are not finite, not enough free space, or a file could not be written.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1 (or None to keep every checkpoint), not {keep}")
    engine = model.engine
    model.check_finite()  # a NaN step never overwrites a good checkpoint (NonFiniteError; engine/finite.py)
    comm, plan = _world_and_plan(engine)
    root = Path(path).absolute()
    final = root / files.step_dir_name(step)
    temporary = root / f".{final.name}.tmp"
    refused = f"the checkpoint of step {step} was not saved to {root}: "

    # 1. This job owns the root; what a dead job's save left there goes.
    notes: list[str] = []
    error = None
    if comm.rank == 0:
        try:
            notes = files.acquire_lock(root)
            notes += files.remove_temporaries(root)
        except CheckpointError as failure:
            error = f"rank 0: {failure}"
        except OSError as failure:
            error = f"rank 0: cannot write checkpoints to {root}: {failure}"
    _agree(comm, error)
    _note(comm, notes)

    # 2. What would be written, checked on every rank before anything is.
    full = model.state_dict()  # collective: rank 0 gathers the full weights (the others get {}) and writes them
    shard = {
        "format": FORMAT_VERSION,
        "rank": comm.rank,
        "world_size": comm.world_size,
        "masters": [chunk.master.detach().cpu().clone() for chunk in engine.chunks],
        "optimizer": _to_cpu(optimizer.shard_state_dict()),
        "skipped_steps": int(optimizer.skipped_steps),
        "replicated": _replicated(engine),
        "rng": _rng_state(engine.device),
    }
    error = None
    try:
        files.check_loadable(shard["optimizer"], "the optimizer state")
    except CheckpointError as failure:
        error = str(failure)
    need_bytes = files.tensor_bytes(shard) + files.FILE_OVERHEAD_BYTES
    if comm.rank == 0:
        need_bytes += files.tensor_bytes(full) + 2 * files.FILE_OVERHEAD_BYTES
    reports = gather_objects(comm, (_non_finite(engine, optimizer), error, need_bytes), all_ranks=True)
    assert reports is not None
    bad = [f"rank {rank}: {what}" for rank, (what, _, _) in enumerate(reports) if what]
    if bad:
        raise CheckpointError(
            f"refusing to save the checkpoint of step {step} to {root}: NaN or infinite values in "
            f"{'; '.join(bad)}; the training diverged (lower the learning rate, check the data for bad "
            "values); the checkpoints already there are kept"
        )
    _agree(comm, next((e for _, e, _ in reports if e), None), prefix=refused)
    need_total = sum(n for _, _, n in reports)
    error = None
    if comm.rank == 0:
        free = files.free_bytes(root)
        if need_total > free:
            error = (
                f"not enough space on {root}: need {files.human_bytes(need_total)}, have {files.human_bytes(free)} "
                f"(the checkpoint of step {step} was not written; the checkpoints already there are kept)"
            )
        else:
            try:
                if temporary.exists():
                    shutil.rmtree(temporary)
                temporary.mkdir(parents=True)
            except OSError as failure:
                error = f"{refused}rank 0: cannot create {temporary}: {failure}"
    _agree(comm, error)

    # 3. The files, into the temporary directory; any failure removes it.
    records, error = {}, None
    try:
        records[rank_file_name(comm.rank)] = files.write_tensors(shard, temporary / rank_file_name(comm.rank))
        if comm.rank == 0:
            records[MODEL_NAME] = files.write_tensors(full, temporary / MODEL_NAME)
    except CheckpointError as failure:
        # The free space as the failing rank saw it, inside its gathered text: every rank then raises the
        # same message (each measuring for itself would differ as the disk fills).
        error = f"rank {comm.rank}: {failure} (free on that filesystem: {_free_text(root)})"
    written = gather_objects(comm, (error, records), all_ranks=True)
    assert written is not None
    errors = [e for e, _ in written if e]
    if errors:
        if comm.rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        raise CheckpointError(f"{refused}{'; '.join(errors)}; the checkpoints already there are kept")

    # 4. meta.json last (it marks the directory complete), then rename, point latest, rotate.
    error, notes = None, []
    if comm.rank == 0:
        meta = {
            "format": FORMAT_VERSION,
            "fingerprint": plan.model.fingerprint,
            "layout": plan_layout(plan),
            "world_size": comm.world_size,
            "tensor_degree": plan.parallel.tensor.degree,
            "chunk_size": plan.memory.chunk_size,
            "dtype": plan.training.dtype,
            "optimizer": optimizer.optimizer_class.__name__,
            "step": int(step),
            "extra": extra or {},
            "torch_version": torch.__version__,
            "saved_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "files": {name: record for _, part in written for name, record in sorted(part.items())},
        }
        meta[files.META_CHECKSUM_KEY] = files.meta_checksum(meta)
        try:
            files.write_json_atomically(temporary / META_NAME, meta)
            files.publish(temporary, final)
            files.rotate(root, keep, final)
            if (root / META_NAME).is_file():
                notes.append(
                    f"{root} also holds an older single checkpoint at its top level; it is kept as it is "
                    "(not rotated); --resume of the directory now takes its latest step-* checkpoint"
                )
        except (OSError, CheckpointError) as failure:
            shutil.rmtree(temporary, ignore_errors=True)
            error = f"{refused}rank 0: {failure}"
    _agree(comm, error)  # nobody returns before the checkpoint is in place
    _note(comm, notes)
    return final


def _read_error(failure: Exception, rank: int) -> str:
    """A failed read as one line; an OSError the file readers did not turn into a CheckpointError names
    the rank (a file one rank cannot read, as on a filesystem not mounted alike everywhere)."""
    if isinstance(failure, CheckpointError):
        return str(failure)
    what = getattr(failure, "filename", None) or "the checkpoint"
    return f"rank {rank} cannot read {what}: " + " ".join(str(failure).split())


def _free_text(root: Path) -> str:
    try:
        return files.human_bytes(files.free_bytes(root))
    except OSError:
        return "unknown"


def read_meta(path: str | os.PathLike) -> dict:
    """The ``meta.json`` of a checkpoint (a checkpoint directory, or a root: its latest checkpoint's).

    Raises:
        CheckpointError: ``path`` is not a complete checkpoint, or its meta.json is damaged.
    """
    directory, _ = files.resolve(Path(path))
    return files.read_meta(directory / META_NAME)


def load_checkpoint(path: str | os.PathLike, model, optimizer) -> dict:
    """Restores a checkpoint saved by :func:`save_checkpoint` (every rank calls it).

    The same plan layout (world size, chunk size, chunk packing) restores this rank's shards,
    optimizer state, loss scaler, skipped steps and RNG state exactly: training continues bitwise as
    if never stopped. Another layout restores only the weights (from ``model.pt``) and warns that
    the optimizer state starts afresh. Every file of the checkpoint, read or not, is first checked against
    the size and sha256 that meta.json records; files load with ``weights_only=True``: nothing stored in them runs.

    Args:
        path: a checkpoint root (its ``latest`` checkpoint is loaded) or one checkpoint directory.
        model: the ElixirModel from ``elixir_tune.setup``.
        optimizer: its ShardedOptimizer.

    Returns:
        The checkpoint's meta (``step``, ``extra``, ``world_size``, ...), plus ``exact``: whether
        optimizer state was restored, and ``directory``: the checkpoint loaded.

    Raises:
        CheckpointError: on every rank, before any state changes: not a complete checkpoint, a
            damaged meta.json, a missing, truncated, corrupt or unsafe file (named), or a shard that
            does not fit this plan.
        CheckpointError: the checkpoint belongs to another model (fingerprint differs; a ValueError, as before).
    """
    engine = model.engine
    comm, plan = _world_and_plan(engine)
    error: str | None = None
    notes: list[str] = []
    meta: dict = {}
    directory = Path(path)
    try:
        directory, notes = files.resolve(Path(path))
        meta = files.read_meta(directory / META_NAME)
        if not isinstance(meta["format"], int) or meta["format"] > FORMAT_VERSION:
            raise CheckpointError(
                f"{directory / META_NAME} has format {meta['format']!r}; this elixir-tune reads formats up to "
                f"{FORMAT_VERSION}: upgrade elixir-tune"
            )
    except (CheckpointError, OSError) as failure:  # a rank that cannot read agrees, then raises
        error = _read_error(failure, comm.rank)
    _agree(comm, error)
    _note(comm, notes)
    if meta.get("fingerprint") != plan.model.fingerprint:  # a CheckpointError: the recipes' one line, no traceback
        raise CheckpointError(
            f"checkpoint {directory} was saved for another model: its fingerprint is {meta.get('fingerprint')}, "
            f"this model's plan has {plan.model.fingerprint} (parameter names, shapes or dtypes differ): resume with "
            "the plan and model it was saved with, or start without --resume"
        )
    optimizer.steps_done = int(meta.get("step", 0))  # a NonFiniteError names steps as the whole run counts them
    records = meta.get("files")
    if not isinstance(records, dict):
        records = None
        _note(comm, [f"{directory} has no checksums (saved by an older elixir-tune): its files cannot be verified"])
    same_layout = meta.get("layout") == plan_layout(plan) and meta.get("world_size") == comm.world_size
    same_optimizer = meta.get("optimizer") == optimizer.optimizer_class.__name__
    cannot, advice = f"cannot resume from {directory}: ", files.damage_advice(directory)
    verified: set[str] = set()
    error = None
    try:  # every file, whichever of them loads: a damaged model.pt is found on an exact resume too
        if records is not None:
            verified = files.verify_share(directory, records, int(meta["world_size"]), comm.rank, comm.world_size)
    except (CheckpointError, OSError) as failure:  # a rank that cannot read agrees, then raises
        error = _read_error(failure, comm.rank)
    _agree(comm, error, prefix=cannot, advice=advice)
    if same_layout and same_optimizer:
        shard = None
        try:
            shard = _read_checked(directory, rank_file_name(comm.rank), records, verified)
            _check_shard(shard, engine, directory / rank_file_name(comm.rank))
        except (CheckpointError, OSError) as failure:  # a rank that cannot read agrees, then raises
            error = _read_error(failure, comm.rank)
        _agree(comm, error, prefix=cannot, advice=advice)
        assert shard is not None  # every rank read its shard (_agree raised otherwise)
        _load_shards(shard, engine, optimizer)
        meta["exact"] = True
        meta["directory"] = str(directory)
        return meta
    why = (
        f"it was saved with world size {meta.get('world_size')} and chunk size {meta.get('chunk_size')}, "
        f"this run has {comm.world_size} and {plan.memory.chunk_size}{_tensor_note(meta, plan)}"
        if not same_layout
        else f"it was saved with {meta.get('optimizer')}, this run uses {optimizer.optimizer_class.__name__}"
    )
    warnings.warn(
        f"checkpoint {directory}: {why}; loading the weights only (model.pt): the optimizer state "
        "(moments, step counts, loss scale) could NOT be restored and starts afresh",
        stacklevel=2,
    )
    full = None
    try:
        full = _read_checked(directory, MODEL_NAME, records, verified)
    except (CheckpointError, OSError) as failure:  # a rank that cannot read agrees, then raises
        error = _read_error(failure, comm.rank)
    _agree(comm, error, prefix=cannot, advice=advice)
    with torch.no_grad():
        model.load_state_dict(full)
    meta["exact"] = False
    meta["directory"] = str(directory)
    return meta


def _tensor_note(meta: dict, plan: Plan) -> str:
    """The tensor degrees of the checkpoint and this run when they differ (pieces of another split)."""
    saved = meta.get("tensor_degree", 1)
    degree = plan.parallel.tensor.degree
    if saved == degree:
        return ""
    return f" (tensor degree {saved} then, {degree} now: the shards hold pieces of another split)"


def _read_checked(directory: Path, name: str, records: dict | None, verified: set[str]):
    """The tensors of ``directory/name``, after checking it against meta.json's record of it (unless this
    rank has just done so: ``verified``)."""
    if records is not None and name not in records:
        raise CheckpointError(f"{directory / META_NAME} records no checksum for {name}: the metadata is damaged")
    if name not in verified:
        files.verify_file(directory / name, records[name] if records is not None else None)
    return files.read_tensors(directory / name)


def _check_shard(shard, engine, path: Path) -> None:
    masters = shard.get("masters") if isinstance(shard, dict) else None
    if (
        not isinstance(masters, list)
        or len(masters) != len(engine.chunks)
        or any(
            not isinstance(m, torch.Tensor) or m.shape != c.master.shape
            for m, c in zip(masters, engine.chunks, strict=True)
        )
        or "optimizer" not in shard
    ):
        raise CheckpointError(f"{path} does not match this plan's chunks (another plan's shard, or a damaged file)")


def _world_and_plan(engine):
    """Every rank of the run and the whole plan: a pipeline rank's engine holds its stage's chunks
    only (``engine.plan``), but files are named by global rank and the layout is the whole plan's."""
    pipeline = engine.pipeline
    return engine.mesh.world, pipeline.full_plan if pipeline is not None else engine.plan


@torch.no_grad()
def _load_shards(shard: dict, engine, optimizer) -> None:
    masters = shard["masters"]
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
