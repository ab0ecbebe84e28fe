"""Where ``--save-pretrained DIR`` may write: a new or empty directory, or an earlier export of this tool.

An export replaces the files of its names in DIR (``config.json``, ``model.safetensors``, the tokenizer's, the
adapter's) and removes the weight files of an earlier save that it does not rewrite. In a directory of the
user's (the source model's own directory, a folder of notes and configs) that would overwrite their files
without a word, so such a directory is refused, before any worker starts (the preflight) and again before the
export is written. An export leaves a marker file, ``MARKER_NAME``, that names it: the next run may replace it,
as a run's checkpoints replace the earlier ones.
"""

from __future__ import annotations

import json
from pathlib import Path

# Written into DIR after a complete export (hidden: from_pretrained and the Hub ignore it).
MARKER_NAME = ".elixir-tune-export.json"
# The settings a run writes into its --save and --save-pretrained directories (settings_file.py).
SETTINGS_NAME = "elixir-tune.settings.yaml"
# A killed save's staging directory (engine/io/pretrained_files.py): the next save clears it. The run's settings
# are written before it trains, and the next run replaces them.
STAGING_NAMES = (".elixir-save.tmp", SETTINGS_NAME)


def foreign_entries(directory: Path) -> list[str]:
    """The entries of ``directory`` that no elixir-tune export wrote; empty when it is missing, empty, or an
    earlier export (its marker is there)."""
    if not directory.is_dir() or (directory / MARKER_NAME).is_file():
        return []
    return _entries(directory)


def _entries(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir() if entry.name not in (MARKER_NAME, *STAGING_NAMES))


def export_dir_problem(value: str | None) -> str | None:
    """``--save-pretrained DIR`` names a directory that holds the user's files: one line saying which and what
    to do, or None.

    Args:
        value: the option's value (None: not given).
    """
    if not value:
        return None
    found = foreign_entries(Path(value))
    if not found:
        return None
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    return (
        f"--save-pretrained {value}: the directory holds files that are not an elixir-tune export ({shown}), "
        "which the export would overwrite: give a new or empty directory, or move those files away"
    )


def mark_export(directory: Path, recipe: str, written: str) -> None:
    """Marks ``directory`` as this tool's export (after every file of it is in place).

    Args:
        directory: the export.
        recipe: the recipe that wrote it.
        written: what it holds, as the closing line says it.
    """
    marker = {"written_by": f"elixir-tune {recipe}", "holds": written, "files": _entries(directory)}
    (directory / MARKER_NAME).write_text(json.dumps(marker, indent=1) + "\n")
