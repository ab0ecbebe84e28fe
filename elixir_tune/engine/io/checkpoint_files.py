"""The files of a checkpoint, one process at a time: safe writing and reading, checksums, the
directory layout and its rotation, the writer's lock, free space.

Nothing here is collective: ``checkpoint.py`` calls these on the ranks that need them and makes the
ranks agree on the outcome. Every problem is a :class:`CheckpointError` whose message is one line
naming the file and what is wrong.

Layout of a checkpoint root (the ``--save`` directory), as DeepSpeed and torchtitan users know it:

    ckpt/latest           the name of the newest complete checkpoint ("step-000200"), replaced atomically
    ckpt/step-000200/     one checkpoint (meta.json, rank-NNNNN.pt, model.pt)
    ckpt/step-000150/     the one before it (the newest ``keep`` are kept)
    ckpt/.lock            who is writing here (host, pid, start time), locked while that job runs
    ckpt/.step-000250.tmp a save in progress (removed by the next save when its job died)
"""

from __future__ import annotations

import atexit
import datetime
import errno
import fcntl
import hashlib
import json
import os
import pickle
import re
import shutil
import socket
from pathlib import Path
from typing import Any, BinaryIO

import torch

META_NAME = "meta.json"
# meta.json's checksum of itself, and the first format that always carries it.
META_CHECKSUM_KEY = "meta_sha256"
META_CHECKSUM_FORMAT = 3
MODEL_NAME = "model.pt"
LATEST_NAME = "latest"
LOCK_NAME = ".lock"
STEP_PATTERN = re.compile(r"^step-(\d+)$")
TEMPORARY_PATTERN = re.compile(r"^\.step-(\d+)\.(tmp|old)$")
_READ_BLOCK_BYTES = 1 << 20
# Each file of a save may need up to this much beyond its tensors (pickled structure, zip records).
FILE_OVERHEAD_BYTES = 64 << 10


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file and what is wrong."""


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


# ---------------------------------------------------------------------------------------------- files


class _HashingWriter:
    """A write-only file object that hashes what passes through it (one pass over the bytes)."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.digest = hashlib.sha256()
        self.size_bytes = 0
        self.error: OSError | None = None  # torch reports a failed write as "unexpected pos ...": keep the cause

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size_bytes += len(data)
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.file.flush()


def write_tensors(obj: Any, path: Path) -> dict:
    """``torch.save(obj, path)``, flushed to disk; returns ``{"size_bytes", "sha256"}`` of the file.

    Raises:
        CheckpointError: the file could not be written (disk full, file size limit, permissions).
    """
    writer = None
    try:
        with open(path, "wb") as file:
            writer = _HashingWriter(file)
            torch.save(obj, writer)  # type: ignore[arg-type]  # torch.save needs only write()
            writer.flush()
            os.fsync(file.fileno())
    except (OSError, RuntimeError) as error:
        cause = writer.error if writer is not None and writer.error is not None else error
        raise CheckpointError(f"could not write {path}: {_one_line(cause)}") from error
    return {"size_bytes": writer.size_bytes, "sha256": writer.digest.hexdigest()}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(_READ_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def verify_file(path: Path, record: dict | None) -> None:
    """Checks that ``path`` exists and, when ``record`` (from meta.json) is given, has its size and sha256.

    Raises:
        CheckpointError: missing, truncated, grown or changed since the save.
    """
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (the checkpoint is incomplete)")
    if record is None:
        return
    try:  # a rank that cannot read raises what the others can agree on, never a bare OSError alone
        size_bytes = path.stat().st_size
        digest = sha256_of(path) if size_bytes == record["size_bytes"] else ""
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read: {_one_line(error)}") from error
    if size_bytes != record["size_bytes"]:
        what = "truncated" if size_bytes < record["size_bytes"] else "longer than saved"
        raise CheckpointError(
            f"{path} is {what}: {size_bytes} bytes, {META_NAME} records {record['size_bytes']} "
            "(an interrupted copy or a full disk?)"
        )
    if digest != record["sha256"]:
        raise CheckpointError(
            f"{path} is corrupt: its sha256 differs from the one {META_NAME} records (the file changed after the save)"
        )


def verify_share(directory: Path, records: dict, saved_world_size: int, rank: int, world_size: int) -> set[str]:
    """Verifies this rank's share of a checkpoint's files (``verify_file``), so that the job checks every
    file once before any is loaded: its own rank file (the one it reads on an exact resume) and every
    ``world_size``-th of the rest (``model.pt``, the rank files of ranks this run does not have).

    Args:
        directory: the checkpoint.
        records: its meta.json's ``files``: name -> ``{"size_bytes", "sha256"}``.
        saved_world_size: the world size it was saved with (its rank files are 0 .. N-1).
        rank: this process's rank.
        world_size: this run's world size.

    Returns:
        The names verified here.

    Raises:
        CheckpointError: a file is missing, truncated or corrupt, or meta.json records no checksum for one.
    """
    expected = [MODEL_NAME, *(rank_file_name(r) for r in range(saved_world_size))]
    unrecorded = [name for name in expected if name not in records]
    if unrecorded:
        raise CheckpointError(
            f"{directory / META_NAME} records no checksum for {', '.join(unrecorded)}: the metadata is damaged"
        )
    owned = {rank_file_name(r) for r in range(world_size)}
    rest = sorted(name for name in records if name not in owned)
    share = ([rank_file_name(rank)] if rank_file_name(rank) in records else []) + rest[rank::world_size]
    for name in share:
        verify_file(directory / name, records[name])
    return set(share)


def damage_advice(directory: Path) -> str:
    """What to do about a damaged checkpoint: another complete checkpoint beside it, or starting over."""
    try:
        others = [p.name for p in step_dirs(directory.parent) if p.resolve() != directory.resolve()]
    except OSError:
        others = []
    if others:
        return (
            f"resume from another checkpoint (--resume {directory.parent / others[-1]}; "
            f"{', '.join(others)} there) or start over without --resume"
        )
    return "restore the file, or start over without --resume (no other checkpoint is beside it)"


def read_tensors(path: Path) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain values only; nothing in the file runs.

    Raises:
        CheckpointError: the file holds other objects (refused, never unpickled), or cannot be read.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+)", str(error))
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain values"
            + (f" (it names {found.group(1)})" if found else "")
            + "; refused: loading it could run code stored in the file"
        ) from error
    except Exception as error:  # noqa: BLE001  (zip, pickle and storage errors all mean a damaged file)
        raise CheckpointError(f"{path} cannot be read: {_one_line(error)}") from error


_SAFE_LEAVES = (torch.Tensor, str, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size)


def check_loadable(obj: Any, where: str) -> None:
    """Raises CheckpointError when ``obj`` holds a value that ``weights_only`` loading would refuse
    (found at save time, not when the user resumes)."""
    if isinstance(obj, _SAFE_LEAVES):
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            check_loadable(key, where)
            check_loadable(value, f"{where}[{key!r}]")
        return
    if isinstance(obj, (list, tuple, set)):
        for index, value in enumerate(obj):
            check_loadable(value, f"{where}[{index}]")
        return
    raise CheckpointError(
        f"cannot save {where}: it is a {type(obj).__name__}, and a checkpoint holds only tensors and plain "
        "values (numbers, strings, lists, dicts) so that loading it never runs code"
    )


def read_meta(path: Path) -> dict:
    """The meta.json at ``path``.

    Raises:
        CheckpointError: unreadable, not JSON, or not a checkpoint's metadata.
    """
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (not a complete elixir-tune checkpoint)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} cannot be read: {_one_line(error)}") from error
    except json.JSONDecodeError as error:
        raise CheckpointError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno} column {error.colno}): the "
            "checkpoint's metadata is damaged; resume from another checkpoint"
        ) from error
    missing = [
        key for key in ("format", "step", "fingerprint", "world_size") if not isinstance(meta, dict) or key not in meta
    ]
    if missing:
        raise CheckpointError(f"{path} is not an elixir-tune checkpoint's metadata (no {', '.join(missing)})")
    recorded = meta.get(META_CHECKSUM_KEY)
    if recorded is not None or (isinstance(meta["format"], int) and meta["format"] >= META_CHECKSUM_FORMAT):
        if recorded != meta_checksum(meta):
            raise CheckpointError(
                f"{path} was changed after the save (its {META_CHECKSUM_KEY} does not match its contents): the step, "
                "fingerprint or layout it states cannot be trusted; restore the file or resume from another checkpoint"
            )
    # A metadata file from before the checksum is read as it is: its fields must at least have their types.
    for key in ("format", "step", "world_size", "fingerprint"):
        value = meta[key]
        if key == "fingerprint":
            fits, wanted = isinstance(value, str), "string"
        else:
            fits, wanted = isinstance(value, int) and not isinstance(value, bool) and value >= 0, "non-negative integer"
        if not fits:
            raise CheckpointError(
                f"{path}: {key} is {value!r}, not a {wanted}: the checkpoint's metadata is damaged; resume from "
                "another checkpoint"
            )
    return meta


def meta_checksum(meta: dict) -> str:
    """The sha256 of a checkpoint's metadata without its own checksum field (keys sorted, compact JSON):
    a meta.json edited after the save (its step, fingerprint or file records) no longer matches it."""
    body = {key: value for key, value in meta.items() if key != META_CHECKSUM_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_json_atomically(path: Path, data: Any) -> None:
    partial = path.with_name(f".{path.name}.tmp")
    with open(partial, "w") as file:
        file.write(data if isinstance(data, str) else json.dumps(data, indent=1))
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def _one_line(error: BaseException, limit: int = 300) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------- layout


def step_dirs(root: Path) -> list[Path]:
    """The complete checkpoints (with meta.json) under ``root``, oldest save first."""
    found = (
        [p for p in root.iterdir() if STEP_PATTERN.match(p.name) and (p / META_NAME).is_file()] if root.is_dir() else []
    )
    return sorted(found, key=lambda p: ((p / META_NAME).stat().st_mtime, p.name))


def resolve(path: Path) -> tuple[Path, list[str]]:
    """The checkpoint directory ``path`` means, and notes for the user.

    ``path`` may be a checkpoint itself (holding meta.json), or a root: its ``latest`` pointer, else
    its newest complete checkpoint. A save that died between its renames left a complete copy beside
    the directory (``.NAME.tmp`` or ``.NAME.old``), which is used then.

    Raises:
        CheckpointError: nothing complete there.
    """
    notes: list[str] = []
    found = _complete_copy(path, notes)
    if found is not None:
        return found, notes
    latest = path / LATEST_NAME
    if latest.is_file():
        try:
            name = latest.read_text(errors="replace").strip()
        except OSError as error:
            raise CheckpointError(f"{latest} cannot be read: {_one_line(error)}") from error
        found = _complete_copy(path / name, notes) if STEP_PATTERN.match(name) else None
        if found is not None:
            return found, notes
        notes.append(f"{latest} names {name[:80]!r}, which is not a complete checkpoint")
    try:
        complete = step_dirs(path)
    except OSError as error:
        raise CheckpointError(f"{path} cannot be listed: {_one_line(error)}") from error
    if complete:
        return complete[-1], [*notes, f"using the newest complete checkpoint there, {complete[-1]}"]
    raise CheckpointError(
        f"{path} is not a complete elixir-tune checkpoint (no {META_NAME}, no {LATEST_NAME} pointer to one, "
        "no complete step-* directory)"
    )


def _complete_copy(directory: Path, notes: list[str]) -> Path | None:
    """``directory`` when it holds meta.json (written after every other file: it is complete), else
    the complete copy a save that died between its two renames left beside it (the new copy, .tmp,
    wins over the one it was replacing, .old)."""
    if (directory / META_NAME).is_file():
        return directory
    for suffix in ("tmp", "old"):
        sibling = directory.parent / f".{directory.name}.{suffix}"
        if (sibling / META_NAME).is_file():
            notes.append(f"{directory} is missing (a save was interrupted while renaming): using {sibling}")
            return sibling
    return None


def remove_temporaries(root: Path) -> list[str]:
    """Removes what an earlier save left in ``root`` when its job died (the caller holds the lock).

    A complete ``.step-N.tmp`` whose ``step-N`` is gone (killed between the renames) is put in place
    instead. Returns notes for the user.
    """
    notes = []
    entries = sorted(root.iterdir()) if root.is_dir() else []
    # The new copy (.tmp) before the one it was replacing (.old): the newer one is put in place.
    for entry in sorted(entries, key=lambda e: (not e.name.endswith(".tmp"), e.name)):
        match = TEMPORARY_PATTERN.match(entry.name)
        if not match:
            continue
        final = root / f"step-{match.group(1)}"
        if (entry / META_NAME).is_file() and not final.exists():
            entry.rename(final)
            notes.append(
                f"put the complete checkpoint {entry.name} left by an interrupted save in place as {final.name}"
            )
        else:
            shutil.rmtree(entry, ignore_errors=True)
            notes.append(f"removed {entry}, the partial save of a job that stopped")
    return notes


def publish(temporary: Path, final: Path) -> None:
    """Renames a complete ``temporary`` to ``final`` (replacing an older copy only once the new one is whole)
    and points ``latest`` at it."""
    old = final.parent / f".{final.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    temporary.rename(final)
    if old.exists():
        shutil.rmtree(old)
    write_json_atomically(final.parent / LATEST_NAME, final.name + "\n")


def rotate(root: Path, keep: int | None, newest: Path) -> list[Path]:
    """Removes all but the ``keep`` most recently saved checkpoints of ``root`` (``newest`` always
    stays); returns what was removed. ``keep`` None keeps all."""
    if keep is None:
        return []
    older = [p for p in step_dirs(root) if p != newest]
    doomed = older[: max(0, len(older) - (keep - 1))]
    for directory in doomed:
        shutil.rmtree(directory)
    return doomed


# --------------------------------------------------------------------------------------------- lock

_held_locks: dict[str, int] = {}  # root -> the open, locked file descriptor (held until this process exits)


def _holder_text(fd: int) -> str:
    raw = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    try:
        holder = json.loads(raw)
        return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return raw[:200]


def acquire_lock(root: Path) -> list[str]:
    """Makes this process the only writer of ``root`` until it exits (an ``flock`` on ``root/.lock``,
    which the kernel releases when the holder dies, kill -9 included). Returns notes for the user.

    Raises:
        CheckpointError: a live job holds the lock (the message names its host, pid and start time).
    """
    key = str(root)
    if key in _held_locks:
        return []
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise CheckpointError(f"cannot write checkpoints to {root}: {_one_line(error)}") from error
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            holder = _holder_text(fd)
            os.close(fd)
            raise CheckpointError(
                f"{root} is in use by another job ({holder}; lock file {root / LOCK_NAME}): "
                "two jobs saving to one directory would replace each other's checkpoints; save to another "
                "directory or stop that job"
            ) from None
        os.close(fd)  # a filesystem without locks: go on, saying so
        return [f"cannot lock {root / LOCK_NAME} ({_one_line(error)}): nothing stops another job from saving there"]
    notes = []
    previous = _holder_text(fd)
    if previous:
        notes.append(f"took over the lock of {root} from a job that is gone ({previous})")
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    _held_locks[key] = fd
    atexit.register(release_lock, root)  # a clean exit empties the file: no "job that is gone" note next time
    return notes


def release_lock(root: Path) -> None:
    """Gives up the lock on ``root`` (emptied: the next job takes it without a note)."""
    fd = _held_locks.pop(str(root), None)
    if fd is not None:
        os.ftruncate(fd, 0)
        os.close(fd)


def free_bytes(path: Path) -> int:
    """Bytes free to this user on the filesystem of ``path`` (a hook: tests replace it to simulate a full disk)."""
    return shutil.disk_usage(path).free


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct tensor storages in ``obj`` (what torch.save writes for them)."""
    seen: dict[int, int] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(obj)
    return sum(seen.values())
