"""The file side of a failed save, in one process: a Hugging Face export is staged and renamed into
place whole (engine/io/pretrained_files.py), its failures are kept as one line naming the rank, the
file and the cause, and a checkpoint file that cannot be read is a CheckpointError, not a bare OSError
on one rank (the multi-process behaviour is tests/distributed/test_save_faults.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from elixir_tune.engine.comm import Comm, shared_errors
from elixir_tune.engine.io.checkpoint_files import CheckpointError, verify_file
from elixir_tune.engine.io.pretrained import _Entry
from elixir_tune.engine.io.pretrained_files import STAGING_NAME, ExportDir, Writer


def _export(directory: Path, values: dict[str, torch.Tensor], files: int = 1) -> ExportDir:
    """Stages ``values`` as safetensors files the way save_pretrained's rank 0 does, then publishes them."""
    export = ExportDir(directory, rank=0)
    export.prepare()
    entries = [
        _Entry(name, tuple(value.shape), value.dtype, value.numel() * value.element_size())
        for name, value in values.items()
    ]
    for index, entry in enumerate(entries):
        entry.file = index * files // len(entries)
    writer = Writer(export, entries, files)
    for entry, value in zip(entries, values.values(), strict=True):
        writer.write(entry, value)
    writer.close()
    if files > 1:
        export.write_text("model.safetensors.index.json", "{}")
    export.publish()
    return export


def test_a_new_export_replaces_the_old_weight_files_and_keeps_the_rest(tmp_path):
    out = tmp_path / "out"
    first = _export(out, {"a": torch.ones(3), "b": torch.zeros(2)}, files=2)
    assert first.error is None
    (out / "tokenizer.json").write_text("{}")  # the recipe's tokenizer files live beside the weights
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    second = _export(out, {"a": torch.full((3,), 2.0), "b": torch.ones(2)})
    assert second.error is None
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "tokenizer.json"]  # no stale shard, no index
    loaded = load_file(out / "model.safetensors")
    assert torch.equal(loaded["a"], torch.full((3,), 2.0)) and torch.equal(loaded["b"], torch.ones(2))


def test_a_path_under_a_regular_file_is_one_line_naming_the_rank_and_creates_nothing(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    export = ExportDir(blocker / "out", rank=0)
    export.prepare()
    assert export.error == (
        f"rank 0 could not create {blocker / 'out'}: [Errno 20] Not a directory; nothing in {blocker / 'out'} was replaced"
    )
    export.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_failed_save_leaves_an_existing_directory_as_it_was(tmp_path):
    out = tmp_path / "out"
    _export(out, {"a": torch.ones(3)})
    before = (out / "model.safetensors").read_bytes()
    export = ExportDir(out, rank=0)
    export.prepare()
    (export.staging / "model.safetensors").write_bytes(b"half")  # what a failed write left
    export.fail(f"write {export.final_path('model.safetensors')}", OSError(28, "No space left on device"))
    export.publish()  # refuses: nothing moves after a failure
    export.abort()
    assert export.error == (
        f"rank 0 could not write {out / 'model.safetensors'}: [Errno 28] No space left on device; nothing in {out} was "
        "replaced"
    )
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"] and not (out / STAGING_NAME).exists()
    assert (out / "model.safetensors").read_bytes() == before


def test_a_new_directory_is_removed_again_when_its_save_fails(tmp_path):
    export = ExportDir(tmp_path / "new" / "out", rank=0)
    export.prepare()
    export.fail("write x", OSError(27, "File too large"))
    export.abort()
    assert not (tmp_path / "new" / "out").exists()


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux's /proc")
def test_a_checkpoint_file_that_cannot_be_read_is_a_checkpoint_error():
    # /proc/self/mem: a regular file of size 0 whose read fails with EIO, as a damaged disk or an
    # unreachable network filesystem would (permissions do not stop root, which runs CI here).
    with pytest.raises(CheckpointError, match=r"/proc/self/mem cannot be read: \[Errno 5\] Input/output error"):
        verify_file(Path("/proc/self/mem"), {"size_bytes": 0, "sha256": "0" * 64})


def test_shared_errors_of_a_world_of_one():
    comm = Comm(0, 1, "local", torch.device("cpu"))
    assert shared_errors(comm, None) == []
    assert shared_errors(comm, "rank 0 could not write x") == ["rank 0 could not write x"]


def test_a_rename_that_fails_midway_says_so(tmp_path):
    out = tmp_path / "out"
    (out / "model.safetensors.index.json").mkdir(parents=True)  # a directory where the index must go
    (out / "model.safetensors.index.json" / "x").write_text("x")
    export = _export(out, {"a": torch.ones(3), "b": torch.zeros(2)}, files=2)
    assert export.error is not None and export.error.startswith(f"rank 0 could not move the new files into {out}: ")
    assert export.error.endswith(f"; {out} may hold some of the new files beside the old ones")  # the weights moved
