"""What a user reads when elixir-run refuses a job, with the real console script and real workers: one line
that says what is wrong (and on which rank), never a worker's traceback or torchrun's own failure report."""

from __future__ import annotations

import json
import re

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


def _script(tmp_path, text: str):
    script = tmp_path / "train.py"
    script.write_text(text)
    return script


def test_an_engine_refusal_in_the_workers_is_one_line_naming_the_rank(tmp_path):
    """Each rank printed the refusal's traceback, torchrun its 'failed (exitcode: 1)' line, then elixir-run its
    summary: the one sentence that mattered came three times, among 40 lines."""
    script = _script(
        tmp_path,
        "import torch\nimport elixir_tune\n\n"
        "model = torch.nn.Linear(4, 4)  # not the plan's model\n"
        "elixir_tune.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))\n",
    )
    result = run_elixir([EXAMPLE_PLAN, script], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    (line,) = [line for line in output.splitlines() if "error" in line.lower()]
    assert re.match(r"error: ranks? [01](, 1)?: the plan was made for another model: its model fingerprint is ", line)
    assert line.endswith("again for this model"), line
    assert "Traceback" not in output and "failed (exitcode" not in output and "hint:" not in output, output


def test_a_worker_that_exits_with_its_own_status_leaves_out_torchruns_report(tmp_path):
    script = _script(
        tmp_path,
        "import os, sys\n\nif os.environ['RANK'] == '1':\n    sys.exit('train.py: --lr must be positive')\n",
    )
    result = run_elixir([EXAMPLE_PLAN, script], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "train.py: --lr must be positive\n" in result.stderr
    assert "error: the job failed: worker rank 1 (local rank 1, pid " in result.stderr
    assert "failed (exitcode" not in output and "Traceback" not in output, output


def test_a_worker_that_crashes_keeps_its_traceback_and_torchruns_report(tmp_path):
    """What the quiet refusals must not hide: an unexpected error is a crash, and its report stays whole."""
    script = _script(tmp_path, "import os\n\nif os.environ['RANK'] == '1':\n    {}['missing']\n")
    result = run_elixir([EXAMPLE_PLAN, script], cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback (most recent call last)" in result.stderr and "KeyError: 'missing'" in result.stderr
    assert re.search(r"failed \(exitcode: 1\) local_rank: 1 \(pid: \d+\)", result.stderr), result.stderr
    assert "error: the job failed: worker rank 1 (local rank 1, pid " in result.stderr
