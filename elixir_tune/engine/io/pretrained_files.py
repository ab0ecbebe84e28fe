"""The files of a Hugging Face export, on the rank that writes them (``save_pretrained``'s rank 0).

Nothing here is collective: ``pretrained.py`` streams the weights to rank 0 and makes every rank
agree on the outcome. What this module promises:

* **Nothing half-written under a final name.** Every file goes into ``DIR/.elixir-save.tmp/`` first;
  only when all of them (weights, index, configs) are complete are they renamed into ``DIR``, each
  replacing the file of the same name at once (``os.replace``), then the weight files of the earlier
  save that the new one does not have are removed. A failed save leaves ``DIR`` as it was: the
  previous export stays loadable, byte for byte.
* **The first failure is kept, not raised.** A write that fails (disk full, a file size limit,
  permissions, a path that is not a directory) is recorded as one line naming the rank, the file
  (under its final name) and the cause, and the writer writes nothing more; the stream goes on so
  that no other rank is left waiting in a collective, and the ranks raise :class:`SaveError`
  together at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, BinaryIO

import torch

from elixir_tune.engine.io.weights import INDEX_NAME, WEIGHTS_NAME

STAGING_NAME = ".elixir-save.tmp"  # inside the target directory: same filesystem, so the renames are atomic

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class SaveError(OSError):
    """``save_pretrained`` could not write the model; every rank raises it with the same message,
    which names the rank, the file and the cause. The directory keeps what it held before."""


def describe_failure(failure: BaseException) -> str:
    """``[Errno 28] No space left on device`` for an OSError (the path is named by the caller), else
    the exception's type and first line."""
    if isinstance(failure, OSError) and failure.errno is not None and failure.strerror:
        return f"[Errno {failure.errno}] {failure.strerror}"
    text = " ".join(str(failure).split())
    return f"{type(failure).__name__}: {text[:300]}" if text else type(failure).__name__


class ExportDir:
    """One save's target on the writing rank: the directory, its staging directory, the first failure.

    Args:
        directory: the Hugging Face directory the user asked for.
        rank: the writing rank's global rank (named in the error).
        replaces_model: whether the save is a model's weights, which replace the earlier save's: its
            ``model*.safetensors`` files and index that the new save lacks are removed (a LoRA adapter's
            save leaves them).
    """

    def __init__(self, directory: Path, rank: int, replaces_model: bool = True) -> None:
        self.directory = directory
        self.staging = directory / STAGING_NAME
        self.rank = rank
        self.replaces_model = replaces_model
        self.error: str | None = None  # the first failure, one line
        self._created = False  # whether this save created ``directory`` (removed again when it fails)
        self._moved = False  # whether a new file has replaced one in ``directory`` yet

    def fail(self, what: str, failure: BaseException) -> None:
        """Records the first failure: ``rank R could not WHAT: CAUSE; what DIR holds now``."""
        if self.error is None:
            outcome = (
                f"{self.directory} may hold some of the new files beside the old ones"
                if self._moved
                else f"nothing in {self.directory} was replaced"
            )
            self.error = f"rank {self.rank} could not {what}: {describe_failure(failure)}; {outcome}"

    def final_path(self, name: str) -> Path:
        """Where the staged file ``name`` ends up (the name errors show)."""
        return self.directory / name

    def prepare(self) -> None:
        """Creates the directory (if needed) and an empty staging directory inside it (a killed save's goes)."""
        try:
            self._created = not self.directory.exists()
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as failure:
            self.fail(f"create {self.directory}", failure)
            return
        try:
            if self.staging.exists():
                shutil.rmtree(self.staging)
            self.staging.mkdir()
        except OSError as failure:
            self.fail(f"write in {self.directory}", failure)

    def write_text(self, name: str, text: str) -> None:
        """A small file (the index) into the staging directory."""
        if self.error is None:
            try:
                (self.staging / name).write_text(text)
            except OSError as failure:
                self.fail(f"write {self.final_path(name)}", failure)

    def save_configs(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        """``config.json`` (with the stored dtype) and ``generation_config.json``, from the model's own."""
        if self.error is not None:
            return
        try:
            _save_configs(module, self.staging, dtype)
        except Exception as failure:  # noqa: BLE001  (transformers' writers raise more than OSError)
            self.fail(f"write the configs into {self.directory}", failure)

    def publish(self) -> None:
        """Renames every staged file into the directory, then removes the earlier save's weight files
        that the new save does not replace, and the staging directory."""
        if self.error is not None:
            return
        staged = sorted(path.name for path in self.staging.iterdir())
        # The weights first, the index (which names them) after them, the configs last.
        order = sorted(staged, key=lambda name: (name == INDEX_NAME, not name.endswith(".safetensors"), name))
        try:
            for name in order:
                os.replace(self.staging / name, self.directory / name)
                self._moved = True
            stale: list[Path] = []
            if self.replaces_model:
                stale = [path for path in self.directory.glob("model*.safetensors") if path.name not in staged]
                if INDEX_NAME not in staged:
                    stale.append(self.directory / INDEX_NAME)
            for path in stale:
                path.unlink(missing_ok=True)
            self.staging.rmdir()
        except OSError as failure:
            self.fail(f"move the new files into {self.directory}", failure)

    def abort(self) -> None:
        """After a failure: the staging directory goes, and the directory too when this save created it."""
        shutil.rmtree(self.staging, ignore_errors=True)
        if self._created:
            try:
                self.directory.rmdir()  # only when empty: nothing else was there
            except OSError:
                pass


class Writer:
    """The writing rank's open safetensors file: header first (offsets known), then the data in order.

    After a failed write it writes nothing more (the export holds the error); the caller keeps
    streaming, so that the other ranks' collectives are answered.

    Args:
        export: the save's target (files go into its staging directory).
        entries: every tensor written, in order, each with its file index (``pretrained._Entry``).
        files: the number of files.
    """

    def __init__(self, export: ExportDir, entries: list, files: int):
        self.export = export
        self.entries = entries
        self.files = files
        self.names = [
            WEIGHTS_NAME if files == 1 else f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)
        ]
        self.handle: BinaryIO | None = None
        self.current = -1
        self.expected: list = []

    def _open(self, file: int) -> None:
        """Starts file ``file``: its entries become the expected ones, and its header is written."""
        self.close()
        members = [e for e in self.entries if e.file == file]
        self.current = file
        self.expected = members  # kept in order after a failure too: the stream goes on without writing
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for entry in members:
            header[entry.name] = {
                "dtype": _SAFETENSORS_DTYPES[entry.dtype],
                "shape": list(entry.shape),
                "data_offsets": [offset, offset + entry.nbytes],
            }
            offset += entry.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned

        def create() -> None:
            self.handle = open(self.export.staging / self.names[file], "wb")  # noqa: SIM115  (closed in close())
            self.handle.write(struct.pack("<Q", len(raw)) + raw)

        self._guarded(file, create)

    def write(self, entry, value: torch.Tensor) -> None:
        """Appends ``entry``'s tensor (``value`` at its full shape) to its file."""
        if entry.file != self.current:
            self._open(entry.file)
        if not self.expected or self.expected[0] is not entry:
            raise RuntimeError(f"save_pretrained: {entry.name} written out of order")  # a bug, not a user error
        self.expected.pop(0)
        handle = self.handle
        if self.export.error is not None or handle is None:
            return
        data = value.detach().to(entry.dtype).contiguous().cpu().reshape(-1)
        self._guarded(
            entry.file, lambda: handle.write(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        )

    def _guarded(self, file: int, action) -> None:
        """Runs a file operation unless an earlier one failed; records its failure and closes the file."""
        if self.export.error is not None:
            return
        try:
            action()
        except OSError as failure:
            self.export.fail(f"write {self.export.final_path(self.names[file])}", failure)
            self.close()

    def close(self) -> None:
        """Closes the open file, on disk first (a full disk can show only here)."""
        handle, self.handle = self.handle, None
        if handle is None:
            return
        try:
            if self.export.error is None:
                handle.flush()
                os.fsync(handle.fileno())  # on disk before the rename makes it the export
        except OSError as failure:
            self.export.fail(f"write {self.export.final_path(self.names[self.current])}", failure)
        finally:
            with contextlib.suppress(OSError):  # after a failure the buffer's rest fails again: already recorded
                handle.close()


def _save_configs(module: torch.nn.Module, directory: Path, dtype: torch.dtype) -> None:
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        import copy

        config = copy.deepcopy(config)
        name = str(dtype).removeprefix("torch.")
        for field in ("dtype", "torch_dtype"):
            if hasattr(config, field):
                try:
                    setattr(config, field, name)
                except (AttributeError, TypeError, ValueError):
                    pass
        config.save_pretrained(directory)
    generation = getattr(module, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(directory)
