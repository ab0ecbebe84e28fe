"""A recipe's numbers that parse but cannot mean what was asked are refused by elixir-run before any worker
starts: one line naming the option and what it takes (they used to train with a NaN or negative value, stop at
an odd step, or end in a worker's traceback from torch's AdamW)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from elixir_tune.cli.run import run_command
from elixir_tune.paths import REPO_DIR

EXAMPLE_PLAN = REPO_DIR / "configs" / "plans" / "example.yaml"


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--lr", "nan"], "--lr must be a finite number above 0 (e.g. --lr 3e-4), not nan"),
        (["--lr=-0.01"], "--lr must be a finite number above 0 (e.g. --lr 3e-4), not -0.01"),
        (["--lr", "0"], "--lr must be a finite number above 0"),
        (["--warmup-steps", "-5"], "--warmup-steps must be 0 or more, not -5"),
        (["--clip", "-1"], "--clip is the largest gradient norm kept, a finite number >= 0 (0: no clipping), not -1"),
        (["--clip", "inf"], "--clip is the largest gradient norm kept"),
        (["--stop-at", "0"], "--stop-at must be 1 or more, not 0"),
        (["--stop-at", "-3"], "--stop-at must be 1 or more, not -3"),
        (["--epochs", "nan"], "--epochs must be a finite number above 0, not nan"),
    ],
)
@pytest.mark.parametrize("recipe", ["pretrain", "finetune"])
def test_a_bad_number_is_one_line_before_anything_starts(recipe, options, expected):
    result = CliRunner().invoke(run_command, ["--dry-run", str(EXAMPLE_PLAN), recipe, *options])
    assert result.exit_code == 2, result.output
    assert expected in result.output, result.output
    assert "Traceback" not in result.output
    assert result.output.count("error:") == 1, result.output


def test_an_empty_data_file_is_one_line_before_anything_starts(tmp_path):
    """An empty --data file passed the preflight and every worker died in torch.frombuffer's ValueError."""
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    result = CliRunner().invoke(run_command, [str(EXAMPLE_PLAN), "pretrain", "--data", str(empty), "--steps", "2"])
    assert result.exit_code == 2, result.output
    assert f"--data {empty}: the file is empty; give a text file (its bytes are the tokens)" in result.output
    assert "nothing was started" in result.output and "Traceback" not in result.output
