"""Which data a recipe run trains on, as its checkpoints record it, and whether a resume trains on the same.

Every checkpoint's ``extra`` records ``data``: ``synthetic`` for ``--synthetic`` (pretrain's random tokens), else
the absolute path of ``--data``, and ``data_bytes``: that file's size (a directory's: its files' together; None for
random tokens). A resume whose data is another (random tokens for text, another file, the same path grown or cut)
would go on training on samples the run never had, while its log and checkpoints still name the old data: it is
refused with one line, unless ``--new-data`` says the change is meant, and then it is said at the start.

The size stands in for the contents (a stat, where hashing a large data set would take minutes): an edit that
keeps the size is not seen.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SYNTHETIC = "synthetic"


def data_record(args: argparse.Namespace) -> dict:
    """What a checkpoint records of the run's data.

    Args:
        args: the recipe's options (``data``, and ``synthetic`` for pretrain).

    Returns:
        ``{"data": "synthetic" or the absolute path, "data_bytes": its size or None}``.
    """
    if getattr(args, "synthetic", False):
        return {"data": SYNTHETIC, "data_bytes": None}
    path = Path(args.data).resolve()
    return {"data": str(path), "data_bytes": _size_bytes(path)}


def data_change(saved: dict, args: argparse.Namespace) -> str | None:
    """How this run's data differs from the data a checkpoint was saved with, or None when it is the same.

    Args:
        saved: the checkpoint's ``extra`` (a checkpoint from before ``data`` was recorded: None).
        args: this run's options.

    Returns:
        One clause naming both, e.g. ``the checkpoint was saved training on random tokens (--synthetic), this run
        trains on --data /x/text.txt``.
    """
    if "data" not in saved:
        return None
    now = data_record(args)
    then_data = saved["data"]
    if then_data != SYNTHETIC:  # older checkpoints recorded --data as given: relative to where the run started
        then_data = str(Path(then_data).resolve())
    if then_data != now["data"]:
        return f"the checkpoint was saved training on {_named(then_data)}, this run trains on {_named(now['data'])}"
    then_bytes = saved.get("data_bytes")
    if then_bytes is not None and now["data_bytes"] is not None and then_bytes != now["data_bytes"]:
        return (
            f"{now['data']} changed since the checkpoint was saved ({then_bytes:,} bytes then, "
            f"{now['data_bytes']:,} now)"
        )
    return None


def data_refusal(changed: str) -> str:
    """The line that refuses a resume on other data (``changed``: ``data_change``'s clause)."""
    return f"{changed}: resume on the data it was saved with, or add --new-data to go on with this data"


def resume_data_problem(args: argparse.Namespace) -> str | None:
    """elixir-run's preflight: a ``--resume`` on other data than its checkpoint's, refused before any worker
    starts (a restarted job's resume is checked by the workers, loop.py). A checkpoint that cannot be read is
    left to the workers' load, which names what is wrong with it.

    Returns:
        The refusal, or None.
    """
    if not args.resume or args.new_data:
        return None
    from elixir_tune.engine.io.checkpoint import read_meta
    from elixir_tune.engine.io.checkpoint_files import CheckpointError

    try:
        saved = read_meta(args.resume).get("extra")
    except CheckpointError:
        return None
    changed = data_change(saved, args) if isinstance(saved, dict) else None
    return data_refusal(changed) if changed else None


def _named(data: str) -> str:
    return "random tokens (--synthetic)" if data == SYNTHETIC else f"--data {data}"


def _size_bytes(path: Path) -> int | None:
    """The size of a file, or of a directory's files together (a saved data set); None when it cannot be read."""
    try:
        if path.is_dir():
            return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())
        return path.stat().st_size
    except OSError:
        return None
