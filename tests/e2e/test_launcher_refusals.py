"""What a user reads when elixir-run refuses a job, with the real console script and real workers: one line
that says what is wrong (and on which rank), never a worker's traceback or torchrun's own failure report."""

from __future__ import annotations

import json

import pytest

from tests.e2e.launch_helpers import EXAMPLE_PLAN, run_elixir

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # elixir-run processes, and workers where they start


def test_a_data_file_that_is_not_utf8_is_refused_before_any_worker_starts(tmp_path):
    """pyarrow read the byte into a string without a word: the preflight passed, and every worker then failed
    in its tokenizer with a UnicodeDecodeError traceback."""
    (tmp_path / "empty").mkdir()
    data = tmp_path / "corpus.jsonl"
    good = json.dumps({"text": "the first record"}) + "\n"
    data.write_bytes(good.encode() + b'{"text": "caf\xe9"}\n')  # café in latin-1, not UTF-8
    result = run_elixir([EXAMPLE_PLAN, "finetune", "--model", tmp_path / "empty", "--data", data], cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    offset = len(good) + len('{"text": "caf')
    assert errors[0] == (
        f"error: data file {data} is not UTF-8: line 2 (byte offset {offset}) holds byte 0xe9; save it as UTF-8 "
        "(e.g. iconv -f latin1 -t utf-8)"
    )
    assert "Traceback" not in result.stderr and "starting" not in result.stderr
