"""A recipe's output paths are checked in elixir-run's process before any worker starts: a checkpoint, log
or export that could not be written would otherwise fail at the end of the run (recipes/options.py
``output_problems``; the failures that only writing shows are shared by every rank: test_save_faults.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from click.testing import CliRunner

from elixir_tune.cli.run import run_command
from elixir_tune.paths import REPO_DIR
from elixir_tune.recipes.options import output_problems

EXAMPLE_PLAN = REPO_DIR / "configs" / "plans" / "example.yaml"


def test_paths_that_cannot_be_written_are_one_line_each(tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    (tmp_path / "a-dir").mkdir()
    args = argparse.Namespace(
        log=str(tmp_path / "a-dir"),
        log_dir=str(blocker / "tb"),
        save=str(blocker),
        save_pretrained=str(blocker / "deeper" / "out"),
    )
    assert output_problems(args) == [
        f"--log {tmp_path / 'a-dir'}: is a directory; give a file name",
        f"--log-dir {blocker / 'tb'}: {blocker} is a file, not a directory; give another path",
        f"--save {blocker}: a file is there, where the run writes a directory; give another path",
        f"--save-pretrained {blocker / 'deeper' / 'out'}: {blocker} is a file, not a directory; give another path",
    ]
    fine = argparse.Namespace(log=str(tmp_path / "runs" / "train.json"), save=str(tmp_path / "new" / "ckpt"))
    assert output_problems(fine) == []  # missing directories are created by the run


def test_elixir_run_refuses_them_before_starting(tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    previous = Path.cwd()
    os.chdir(tmp_path)
    try:
        result = CliRunner().invoke(
            run_command, [str(EXAMPLE_PLAN), "pretrain", "--model", "gpt2-tiny", "--save", str(blocker)]
        )
    finally:
        os.chdir(previous)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: --save {blocker}: a file is there, where the run writes a directory; give another path"]
    assert "starting" not in result.output
