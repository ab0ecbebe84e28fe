"""The last faults of the battery (issue 35), each on 2 real gloo workers under elixir-run: one line that says
what happened and what to do, never a traceback, a hang or a rank wrongly blamed."""

from __future__ import annotations

import pytest

from tests.e2e.launch_helpers import WORKERS_DIR, run_elixir, runnable_example_plan

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # torchrun with several worker processes


def test_a_disk_full_before_the_start_is_one_line_naming_rank_0(tmp_path):
    """The lock's first write failed with an OSError traceback on rank 0, and the summary blamed rank 1."""
    plan = runnable_example_plan(tmp_path / "plan.yaml")
    script = WORKERS_DIR / "full_disk_pretrain.py"
    result = run_elixir([plan, script, "--steps", 2, "--save", tmp_path / "ckpt", "--log", tmp_path / "log.json"])
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert f"error: rank 0: cannot write checkpoints to {tmp_path / 'ckpt'}: [Errno 27] File too large" in output
    assert "free space or give another --save" in output
    assert "Traceback" not in output, output[-3000:]
    assert "the job failed: worker rank 0 " in output  # not rank 1, which only waited for rank 0
    assert not list((tmp_path / "ckpt").glob("step-*"))
