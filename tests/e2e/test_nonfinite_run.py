"""A diverging run stops instead of training on NaN: the pretrain recipe at lr 1e6 (fp32, the example
plan on 2 CPU workers, a checkpoint after every step) exits non-zero with the NonFiniteError's message
naming the step, and the last checkpoint is the one before that step (never overwritten by NaN)."""

from __future__ import annotations

import json

import pytest

from elixir_tune.engine.io.checkpoint import read_meta  # the latest step directory
from tests.e2e.launch_helpers import run_elixir, runnable_example_plan

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # torchrun with several worker processes


def test_a_diverging_run_exits_non_zero_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    plan = runnable_example_plan(tmp_path / "plan.yaml")
    checkpoint, log = tmp_path / "ckpt", tmp_path / "log.json"
    args = [plan, "pretrain", "--steps", 10, "--lr", 1e6, "--warmup-steps", 0, "--clip", 0]
    result = run_elixir([*args, "--save", checkpoint, "--save-every", 1, "--log", log])
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "is not finite in fp32" in output and "learning rate" in output, output[-3000:]
    record = json.loads(log.read_text())
    assert record["summary"]["status"] == "non-finite"
    failed_step = int(output.split("optimizer step ")[1].split()[0])
    assert len(record["steps"]) == failed_step - 1  # the failing step is not logged as trained
    assert read_meta(checkpoint)["step"] == failed_step - 1
