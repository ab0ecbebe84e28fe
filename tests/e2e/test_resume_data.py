"""A recipe's checkpoint records the data the run trained on, and a resume goes on with that data only: the pretrain
recipe on one CPU worker, a step of random tokens saved, then resumed with a text file (refused before any worker
starts) and with --new-data (allowed, and said)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.e2e.launch_helpers import run_elixir, runnable_example_plan

pytestmark = [pytest.mark.slow]  # elixir-run starts torchrun and a worker


def _one_worker_plan(path):
    plan = runnable_example_plan(path)
    raw = yaml.safe_load(plan.read_text())
    raw["cluster"]["gpus_per_node"] = 1
    raw["training"].update(global_batch_size=2, micro_batch_size=2, grad_accum_steps=1, seq_len=32)
    plan.write_text(yaml.safe_dump(raw, sort_keys=False))
    return plan


def test_a_synthetic_checkpoint_records_synthetic_and_resumes_on_text_only_with_new_data(tmp_path):
    plan, checkpoint, text = _one_worker_plan(tmp_path / "plan.yaml"), tmp_path / "ckpt", tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    saved = run_elixir([plan, "pretrain", "--synthetic", "--steps", 1, "--save", checkpoint, "--log", tmp_path / "a"])
    assert saved.returncode == 0, (saved.stdout + saved.stderr)[-3000:]
    extra = json.loads((checkpoint / "step-000001" / "meta.json").read_text())["extra"]
    assert extra["data"] == "synthetic" and extra["data_bytes"] is None  # it named the bundled text it never read

    resume = [plan, "pretrain", "--steps", 2, "--resume", checkpoint, "--data", text, "--log", tmp_path / "b.json"]
    refused = run_elixir(resume)
    output = refused.stdout + refused.stderr
    assert refused.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: the checkpoint was saved training on random tokens (--synthetic), this run trains on --data {text}: "
        "resume on the data it was saved with, or add --new-data to go on with this data"
    ]
    assert "starting" not in output and not (tmp_path / "b.json").exists()

    allowed = run_elixir([*resume, "--new-data"])
    output = allowed.stdout + allowed.stderr
    assert allowed.returncode == 0, output[-3000:]
    assert (
        f"warning: --new-data: the checkpoint was saved training on random tokens (--synthetic), this run trains on "
        f"--data {text}; the run goes on with this data"
    ) in output
    assert json.loads((tmp_path / "b.json").read_text())["resumed_from"]["step"] == 1
