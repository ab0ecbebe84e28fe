"""Worker for test_checkpoint_faults.py: one fault per case, on 2 real gloo ranks.

Run by ``engine_launch.py`` (argv: cases.json, output prefix). Every case trains the tiny GPT-2 of
engine_worker for a step, saves a good checkpoint into its own root, then does one harm (a pickle
payload, overwritten bytes, a truncated or missing rank file, a garbled meta.json, NaN weights, a
full disk, a second writer) and reports what each rank saw: the error text, warnings, what is left
on disk, and what loads afterwards.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import elixir_tune
from elixir_tune.engine import CheckpointError
from elixir_tune.engine.io import checkpoint_files as files
from tests.distributed.engine_checkpoint_worker import setup, train

CASE = dict(model="gpt2", chunk_size=4096, cache="all", steps=4)


class Payload:
    """What a hostile rank file holds: unpickling it runs a shell command (touches a marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _save(root: Path, model, opt, step: int, **kwargs) -> tuple[str, list[str]]:
    """Saves; returns (error text or "", warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            elixir_tune.save_checkpoint(root, model, opt, step=step, **kwargs)
            error = ""
        except CheckpointError as failure:
            error = str(failure)
    return error, [str(w.message) for w in caught]


def _load(root: Path, case: dict, world: int) -> tuple[str, list[str], dict]:
    """A fresh setup loads ``root``; returns (error text or "", warnings, what loaded)."""
    model, opt = setup(case, world)
    loaded: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            meta = elixir_tune.load_checkpoint(root, model, opt)
            state = model.state_dict(all_ranks=True)
            loaded = {
                "step": meta["step"],
                "exact": meta["exact"],
                "finite": all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point()),
            }
            error = ""
        except CheckpointError as failure:
            error = str(failure)
    return error, [str(w.message) for w in caught], loaded


def _on_disk(root: Path) -> dict:
    return {
        "entries": sorted(p.name for p in root.iterdir()),
        "latest": (root / "latest").read_text().strip() if (root / "latest").exists() else None,
    }


def _harm_files(case: dict, step_dir: Path, rank: int, marker: Path) -> None:
    """Rank 0 does the case's harm to the saved checkpoint (the other rank waits at a barrier)."""
    if rank == 0:
        meta_path = step_dir / "meta.json"
        meta = json.loads(meta_path.read_text())
        harm = case["harm"]
        if harm in ("pickle", "pickle_old_format"):
            # The attacker also rewrites meta.json's record, so the checksum matches the payload.
            target = step_dir / "rank-00001.pt"
            torch.save({"masters": [Payload(marker)]}, target)
            meta["files"]["rank-00001.pt"] = {"size_bytes": target.stat().st_size, "sha256": files.sha256_of(target)}
            meta[files.META_CHECKSUM_KEY] = files.meta_checksum(meta)  # and meta.json's own checksum
            if harm == "pickle_old_format":
                del meta["files"], meta[files.META_CHECKSUM_KEY]
                meta["format"] = 1
            meta_path.write_text(json.dumps(meta))
        elif harm == "corrupt":
            target = step_dir / "rank-00001.pt"
            with open(target, "r+b") as file:  # 4 KiB in the middle, the size unchanged
                file.seek(target.stat().st_size // 2)
                file.write(os.urandom(4096))
        elif harm == "corrupt_model":  # one byte of model.pt, which an exact resume does not read
            target = step_dir / "model.pt"
            with open(target, "r+b") as file:
                file.seek(target.stat().st_size // 2)
                byte = file.read(1)
                file.seek(-1, os.SEEK_CUR)
                file.write(bytes([byte[0] ^ 0xFF]))
        elif harm == "truncated":
            target = step_dir / "rank-00000.pt"
            os.truncate(target, target.stat().st_size // 2)
        elif harm == "missing":
            (step_dir / "rank-00001.pt").unlink()
        elif harm == "garbled_meta":
            meta_path.write_text('{"format": 2, "step": 1, garbled')
        elif harm == "old_format":  # a checkpoint from before checksums: loads, with a note
            del meta["files"], meta[files.META_CHECKSUM_KEY]
            meta["format"] = 1
            meta_path.write_text(json.dumps(meta))
        elif harm in ("meta_step_edited", "meta_fingerprint_edited"):  # edited by hand: its checksum is stale
            key, value = ("step", 7) if harm == "meta_step_edited" else ("fingerprint", "0123456789abcdef")
            meta[key] = value
            meta_path.write_text(json.dumps(meta, indent=1))
        elif harm == "meta_step_text":  # a format-2 meta.json (no checksum of itself) whose step is no number
            del meta[files.META_CHECKSUM_KEY]
            meta["format"], meta["step"] = 2, "ten"
            meta_path.write_text(json.dumps(meta))
        elif harm == "other_model":  # a consistent checkpoint of another model, as its own save wrote it
            meta["fingerprint"] = "0123456789abcdef"
            meta[files.META_CHECKSUM_KEY] = files.meta_checksum(meta)
            meta_path.write_text(json.dumps(meta))
    dist.barrier()


def run_case(case: dict, rank: int, world: int, root: Path) -> dict:
    full_case = dict(CASE, **case)
    model, opt = setup(full_case, world)
    train(model, opt, full_case, rank, world, 0, 1)
    result: dict = {"first_save": _save(root, model, opt, 1)[0]}
    step_dir = root / "step-000001"
    marker = root.parent / f"{root.name}.payload-ran"
    harm = case["harm"]
    if harm == "rotation":
        for step in (2, 3):
            train(model, opt, full_case, rank, world, step - 1, step)
            _save(root, model, opt, step, keep=2)
        result["disk"] = _on_disk(root)
        result["load"] = _load(root, full_case, world)
        return result
    if harm == "nan":
        if rank == 1:  # the run diverged on one rank
            model.engine.chunks[0].master[0] = float("nan")
        result["save"] = _save(root, model, opt, 2)
    elif harm == "no_space":
        real = files.free_bytes
        files.free_bytes = lambda path: 4096  # the filesystem as a full disk shows it
        try:
            result["save"] = _save(root, model, opt, 2)
        finally:
            files.free_bytes = real
    elif harm == "write_fails":
        # Rank 1's writes stop at half its rank file (a real EFBIG from the kernel, as on a full disk).
        limit = (step_dir / "rank-00001.pt").stat().st_size // 2
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        if rank == 1:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            result["save"] = _save(root, model, opt, 2)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    elif harm == "second_writer":
        other_root = root.parent / f"{root.name}.other"
        holder = None
        if rank == 0:  # another job's writer holds that root
            holder = subprocess.Popen(
                [sys.executable, "-c", _HOLD_LOCK, str(other_root)], stdout=subprocess.PIPE, text=True, env=os.environ
            )
            assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
            result["holder_pid"] = holder.pid
        result["save"] = _save(other_root, model, opt, 2)
        result["other_disk"] = _on_disk(other_root)
        if rank == 0:
            assert holder is not None
            holder.kill()  # SIGKILL: its lock file stays, the kernel drops the lock
            holder.wait()
        result["after_holder_died"] = _save(other_root, model, opt, 2)
    else:
        _harm_files(case, step_dir, rank, marker)
    dist.barrier()
    result["disk"] = _on_disk(root)
    result["load"] = _load(root, full_case, world)
    result["payload_ran"] = marker.exists()
    return result


# The other job: takes the lock of argv[1] (as its rank 0 would), says so, and waits to be killed.
_HOLD_LOCK = """
import sys, time
from pathlib import Path
from elixir_tune.engine.io.checkpoint_files import acquire_lock
print(acquire_lock(Path(sys.argv[1])) and "noted" or "locked", flush=True)
time.sleep(120)
"""


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(lambda case, index, rank, world, out_path: run_case(case, rank, world, Path(f"{out_path}.root{index}")))
