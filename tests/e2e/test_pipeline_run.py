"""elixir-run launches a pipeline plan like any other: the pretrain recipe on 2 CPU workers with the
tiny GPT-2 split into 2 stages (pipeline 2 x data 1; the tied wte / lm_head on both) trains, and a
checkpoint saved mid-run resumes exactly (the same losses, bitwise). That a pipeline plan trains with the
losses of a data-parallel plan through elixir-run is tests/e2e/test_parallel_user_path.py's check.

The plans are written by the test plan builder (tests/distributed/engine_plans.py ``make_plan``,
``stages=2``: each stage's parameters packed apart), for the model the pretrain recipe builds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from elixir_tune.paths import REPO_DIR
from elixir_tune.plan import save_plan
from tests.e2e.launch_helpers import run_elixir

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # torchrun with several worker processes

TRAIN = "pretrain"  # the recipe name: elixir-run runs elixir_tune/recipes/pretrain.py
MODEL = REPO_DIR / "configs" / "models" / "gpt2-tiny.yaml"
SEQ = 32
STEPS = 6


def _plan(path: Path, stages: int) -> Path:
    import torch

    from elixir_tune.profiler import load_model_source
    from tests.distributed.engine_plans import make_plan

    torch.manual_seed(0)
    model = load_model_source(str(MODEL)).build_model()
    # The same global batch of 4: 2 micro-batches of 2 on one data index, or 1 on each of two.
    plan = make_plan(
        model,
        2,
        32768,
        cache="min",
        block_list="transformer.h",
        micro_batch_size=2,
        grad_accum_steps=2 if stages == 2 else 1,
        seq_len=SEQ,
        stages=stages,
    )
    plan.model.source = str(MODEL)
    save_plan(plan, path)
    return path


def _losses(log: Path) -> list[float]:
    return [step["loss"] for step in json.loads(log.read_text())["steps"]]


def test_a_pipeline_plan_trains_and_resumes_exactly(tmp_path):
    pipeline = _plan(tmp_path / "pipeline.yaml", 2)
    assert "stages: 2" in pipeline.read_text()
    common = [TRAIN, "--steps", STEPS, "--seed", "3"]
    whole = run_elixir([pipeline, *common, "--log", tmp_path / "whole.json"], timeout_s=240)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    losses = _losses(tmp_path / "whole.json")
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses)

    # Interrupted at step 3 with a checkpoint, resumed to the end: the same losses, bitwise.
    checkpoint = tmp_path / "ckpt"
    first = run_elixir(
        [pipeline, *common, "--stop-at", 3, "--save", checkpoint, "--log", tmp_path / "a.json"], timeout_s=240
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert sorted(p.name for p in checkpoint.glob("step-000003/rank-*.pt")) == ["rank-00000.pt", "rank-00001.pt"]
    second = run_elixir([pipeline, *common, "--resume", checkpoint, "--log", tmp_path / "b.json"], timeout_s=240)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "weights only" not in second.stdout + second.stderr
    assert _losses(tmp_path / "a.json") + _losses(tmp_path / "b.json") == losses
