"""checkpoint_files on one process: the layout (resolve, rotate, leftovers), safe writing and reading,
and the writer's lock against a real second process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from elixir_tune.engine.io import checkpoint_files as files
from elixir_tune.engine.io.checkpoint_files import CheckpointError


def _fake_checkpoint(directory, step: int, mtime: float) -> None:
    directory.mkdir(parents=True)
    meta = directory / "meta.json"
    meta.write_text(json.dumps({"format": 2, "step": step, "fingerprint": "f", "world_size": 1}))
    os.utime(meta, (mtime, mtime))


def test_resolve_follows_latest_then_the_newest_complete(tmp_path):
    _fake_checkpoint(tmp_path / "step-000010", 10, 100)
    _fake_checkpoint(tmp_path / "step-000020", 20, 200)
    (tmp_path / "latest").write_text("step-000010\n")
    assert files.resolve(tmp_path) == (tmp_path / "step-000010", [])
    assert files.resolve(tmp_path / "step-000020") == (tmp_path / "step-000020", [])
    (tmp_path / "latest").write_text("step-000030\n")  # names a checkpoint that is not there
    directory, notes = files.resolve(tmp_path)
    assert directory == tmp_path / "step-000020" and "not a complete checkpoint" in notes[0]
    with pytest.raises(CheckpointError, match="is not a complete elixir-tune checkpoint"):
        files.resolve(tmp_path / "nothing")


def test_rotate_keeps_the_newest_saves_and_never_the_new_one(tmp_path):
    for step, mtime in ((30, 100), (10, 200), (20, 300)):  # saved in this order
        _fake_checkpoint(tmp_path / f"step-{step:06d}", step, mtime)
    removed = files.rotate(tmp_path, 2, tmp_path / "step-000020")
    assert removed == [tmp_path / "step-000030"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000010", "step-000020"]
    assert files.rotate(tmp_path, None, tmp_path / "step-000020") == []


def test_leftovers_are_removed_or_put_in_place(tmp_path):
    (tmp_path / ".step-000005.tmp").mkdir()  # partial: no meta.json
    _fake_checkpoint(tmp_path / ".step-000007.tmp", 7, 100)  # complete, killed before its rename
    notes = files.remove_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000007"] and len(notes) == 2


def test_writing_records_what_is_on_disk_and_reading_refuses_objects(tmp_path):
    record = files.write_tensors({"w": torch.arange(10.0), "group": {"betas": (0.9, 0.95)}}, tmp_path / "a.pt")
    files.verify_file(tmp_path / "a.pt", record)
    assert record["sha256"] == files.sha256_of(tmp_path / "a.pt")
    assert torch.equal(files.read_tensors(tmp_path / "a.pt")["w"], torch.arange(10.0))
    torch.save({"f": files.Path("x")}, tmp_path / "b.pt")  # any object but tensors and plain values
    with pytest.raises(CheckpointError, match="b.pt holds objects other than tensors"):
        files.read_tensors(tmp_path / "b.pt")
    with pytest.raises(CheckpointError, match=r"cannot save the optimizer state\['f'\]: it is a PosixPath"):
        files.check_loadable({"f": files.Path("x")}, "the optimizer state")


def test_a_live_holder_refuses_and_a_dead_ones_lock_is_taken_over(tmp_path):
    root = tmp_path / "ckpt"
    code = (
        "import sys, time; from pathlib import Path; from elixir_tune.engine.io.checkpoint_files import acquire_lock; "
        "acquire_lock(Path(sys.argv[1])); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError, match=f"in use by another job \\(pid {holder.pid} on host "):
            files.acquire_lock(root)
    finally:
        holder.kill()
        holder.wait()
    started = time.monotonic()
    notes = files.acquire_lock(root)
    try:
        assert time.monotonic() - started < 1 and f"from a job that is gone (pid {holder.pid}" in notes[0]
        assert files.acquire_lock(root) == []  # this process holds it already
    finally:
        files.release_lock(root)
    assert files.acquire_lock(root) == []  # released cleanly: no note
    files.release_lock(root)


def test_every_file_is_verified_once_over_the_ranks_and_damage_names_another_checkpoint(tmp_path):
    """A resume of a 3-rank checkpoint on 2 ranks: the ranks' shares cover every file (model.pt and the rank file
    no rank of this run owns included), each once; a damaged one is named, with another checkpoint to resume."""
    directory = tmp_path / "step-000002"
    directory.mkdir()
    names = ["model.pt", "rank-00000.pt", "rank-00001.pt", "rank-00002.pt"]
    records = {
        name: files.write_tensors({"w": torch.full((4,), float(i))}, directory / name) for i, name in enumerate(names)
    }
    shares = [files.verify_share(directory, records, 3, rank, 2) for rank in range(2)]
    assert "rank-00000.pt" in shares[0] and "rank-00001.pt" in shares[1]
    assert sorted(shares[0] | shares[1]) == names and not shares[0] & shares[1]
    model = directory / "model.pt"
    damaged = bytearray(model.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    model.write_bytes(bytes(damaged))
    owner = 0 if "model.pt" in shares[0] else 1
    with pytest.raises(CheckpointError, match=r"step-000002/model.pt is corrupt: its sha256 differs"):
        files.verify_share(directory, records, 3, owner, 2)
    with pytest.raises(CheckpointError, match=r"records no checksum for rank-00002.pt: the metadata is damaged"):
        files.verify_share(directory, {k: v for k, v in records.items() if k != "rank-00002.pt"}, 3, 0, 2)
    assert files.damage_advice(directory).startswith("restore the file, or start over without --resume")
    _fake_checkpoint(tmp_path / "step-000001", 1, 100)
    assert files.damage_advice(directory) == (
        f"resume from another checkpoint (--resume {tmp_path / 'step-000001'}; step-000001 there) "
        "or start over without --resume"
    )
