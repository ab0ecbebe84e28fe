"""A diverging run stops instead of training on NaN: the pretrain recipe at lr 1e6 (fp32, the example
plan on 2 CPU workers, a checkpoint after every step) exits non-zero with the NonFiniteError's message
naming the step, and the last checkpoint is the one before that step (never overwritten by NaN)."""

from __future__ import annotations

import json

import pytest
import yaml

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


def test_an_fp16_run_whose_loss_stays_nan_stops_before_saving_it(tmp_path):
    """fp16 skips an overflowing step, so it never raised: at lr 1e6 the loss went NaN from step 2 and the run
    saved the unchanged weights every step and exited 0 ("loss 5.5276 -> nan"). Three non-finite steps in a row
    now stop it with one line, and no checkpoint of those steps is written."""
    plan = runnable_example_plan(tmp_path / "plan.yaml")
    raw = yaml.safe_load(plan.read_text())
    raw["training"]["dtype"] = "fp16"
    plan.write_text(yaml.safe_dump(raw, sort_keys=False))
    checkpoint, log = tmp_path / "ckpt", tmp_path / "log.json"
    args = [plan, "pretrain", "--steps", 10, "--lr", 1e6, "--warmup-steps", 0, "--clip", 0]
    result = run_elixir([*args, "--save", checkpoint, "--save-every", 1, "--log", log])
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "did not train: the loss was nan (not finite) for 3 steps in a row" in output, output[-3000:]
    assert "Traceback" not in output
    first_bad = int(output.split("error: fp16 steps ")[1].split("-")[0])
    record = json.loads(log.read_text())
    assert record["summary"]["status"] == "non-finite"
    assert read_meta(checkpoint)["step"] == first_bad - 1  # the last finite step; the NaN ones were never saved
    assert sorted(p.name for p in checkpoint.glob("step-*"))[-1] == f"step-{first_bad - 1:06d}"


@pytest.mark.heavy  # CI time: 14 s; the non-finite stop itself stays in CI
def test_stop_at_before_the_resumed_step_is_refused(tmp_path):
    """--stop-at at or before a checkpoint's step ran nothing and saved the checkpoint again as if trained."""
    plan = runnable_example_plan(tmp_path / "plan.yaml")
    checkpoint = tmp_path / "ckpt"
    first = run_elixir([plan, "pretrain", "--steps", 6, "--stop-at", 3, "--save", checkpoint, "--log", tmp_path / "a"])
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    args = [plan, "pretrain", "--steps", 6, "--stop-at", 2, "--resume", checkpoint, "--save", checkpoint]
    result = run_elixir([*args, "--log", tmp_path / "b.json"])
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "--stop-at 2 is not after the checkpoint's step 3: nothing would train; give a later step" in output
    assert "Traceback" not in output
    assert read_meta(checkpoint)["step"] == 3 and not (tmp_path / "b.json").exists()
