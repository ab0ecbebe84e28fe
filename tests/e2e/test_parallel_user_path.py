"""The user's path with every parallel layout, and interrupted jobs that lose nothing: elixir-run PLAN
pretrain on 2 CPU workers (gloo) with the example data-parallel plan (made runnable) and with plans that
profile -> search made for pipeline=2 (2 micro-batches) and tensor=2; the same global batch, seed, data
and fp32.

Seven jobs, each checking several things (a job start costs seconds: fresh interpreters import torch):
- interrupted: the data plan with --save gets SIGINT after its first logged step; every rank finishes the
  step, saves a sharded checkpoint and exits 130;
- resumed: --resume goes on from that checkpoint to the end;
- data: the same plan straight through. Interrupted + resumed per-step losses and learning rates equal
  these exactly (same data sampler, same LR schedule, bitwise optimizer state);
- pipeline, tensor: the searched pipeline and tensor plans train with the data plan's losses (1e-5);
- pipeline stopped at step 2 with --save, and resumed: the pipeline run's losses, bitwise.

Every run uses one LR schedule (``--steps 40``, one warm-up step: the full rate from the first step) and
ends with ``--stop-at``, so the interrupted run is still going when the signal comes.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import time
from pathlib import Path

import pytest

from elixir_tune.paths import REPO_DIR
from elixir_tune.plan import load_plan
from tests.e2e.launch_helpers import console_script, job_env, run_elixir, runnable_example_plan, tune

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # torchrun with several worker processes

SCHEDULE = ["--steps", 40, "--warmup-steps", 1, "--seed", 5]
PARALLEL_STEPS = 4  # the pipeline and tensor runs
PIPELINE_SAVE_AT = 2


def _losses(log: Path) -> list[float]:
    return [step["loss"] for step in json.loads(log.read_text())["steps"]]


def _steps(log: Path) -> list[tuple[int, float, float]]:
    return [(s["step"], s["loss"], s["lr"]) for s in json.loads(log.read_text())["steps"]]


def _logged_steps(log: Path) -> int:
    try:
        return len(json.loads(log.read_text())["steps"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


def _train(plan: Path, log: Path, *extra) -> subprocess.CompletedProcess:
    result = run_elixir([plan, "pretrain", *SCHEDULE, *extra, "--log", log], timeout_s=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parallel")


@pytest.fixture(scope="module")
def plans(work) -> dict[str, Path]:
    """The data plan: the example plan made runnable (an offloaded chunk, 2 micro-batches, recomputation:
    what the interrupted run must restore); pipeline=2 and tensor=2 plans searched from a profile of the same
    model for the same global batch of 16 x 128 tokens."""
    profile = work / "profile.yaml"
    tune(["profile", "configs/models/gpt2-tiny.yaml", "--batch-size", "4", "--seq-len", "128", "--out", profile])
    found = {"data": runnable_example_plan(work / "data.yaml")}
    # The pipeline plan with 2 micro-batches of 8 (the search alone takes one of 16): micro-batches in flight.
    for name, fixed in {"pipeline": ["pipeline=2", "micro_batch_size=8"], "tensor": ["tensor=2"]}.items():
        found[name] = work / f"{name}.yaml"
        args = ["search", "--gpus", "2", "--hardware", "cpu", "--profile", profile, "--global-batch-size", "16"]
        args += ["--loop", "forward_backward", *(arg for pin in fixed for arg in ("--fix", pin))]
        tune([*args, "--out", found[name]])
    return found


@pytest.fixture(scope="module")
def interrupted(plans, work) -> dict:
    """The data plan with --save, SIGINT to elixir-run after its first logged step."""
    checkpoint, log = work / "ckpt", work / "interrupted.json"
    process = subprocess.Popen(
        [console_script("elixir-run"), *map(str, [plans["data"], "pretrain", *SCHEDULE])]
        + ["--save", str(checkpoint), "--log", str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=job_env(),
        cwd=REPO_DIR,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300  # workers start in seconds; minutes on a loaded machine
        while _logged_steps(log) < 1 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        output = process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            process.kill()
    return {"returncode": process.returncode, "output": output, "log": log, "checkpoint": checkpoint}


@pytest.fixture(scope="module")
def data_log(plans, interrupted, work) -> Path:
    """The data plan straight through, two steps past where the interrupted run stopped (at least as
    long as the parallel runs)."""
    log = work / "data.json"
    _train(plans["data"], log, "--stop-at", max(PARALLEL_STEPS, _logged_steps(interrupted["log"]) + 2))
    return log


@pytest.fixture(scope="module")
def pipeline_log(plans, work) -> Path:
    log = work / "pipeline.json"
    _train(plans["pipeline"], log, "--stop-at", PARALLEL_STEPS)
    return log


@pytest.mark.heavy  # CI time: 14 s; CI keeps the pipeline save and exact resume
def test_sigint_saves_and_resume_continues_exactly(interrupted, data_log, plans, work):
    output, checkpoint = interrupted["output"], interrupted["checkpoint"]
    assert interrupted["returncode"] == 128 + signal.SIGINT, output[-3000:]
    assert "interrupted by SIGINT; the workers were stopped" in output
    record = json.loads(interrupted["log"].read_text())
    assert record["summary"]["status"] == "interrupted"
    steps_before = _steps(interrupted["log"])
    straight = _steps(data_log)
    saved = checkpoint / (checkpoint / "latest").read_text().strip()  # checkpoint/step-NNNNNN
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["step"] == len(steps_before) and 1 <= meta["step"] < len(straight), (meta, output[-2000:])
    assert meta["world_size"] == 2 and meta["extra"]["steps"] == 40
    assert saved.name == f"step-{meta['step']:06d}" and set(meta["files"]) == {
        "model.pt",
        "rank-00000.pt",
        "rank-00001.pt",
    }

    resumed_log = work / "resumed.json"
    resumed = _train(plans["data"], resumed_log, "--stop-at", len(straight), "--resume", checkpoint)
    assert f"resumed from {checkpoint} at step {meta['step']}" in resumed.stdout
    assert json.loads(resumed_log.read_text())["resumed_from"]["step"] == meta["step"]
    assert steps_before + _steps(resumed_log) == straight


@pytest.mark.parametrize("name", ["pipeline", "tensor"])
def test_a_searched_parallel_plan_trains_like_data_parallel(plans, data_log, pipeline_log, work, name):
    plan = load_plan(plans[name])
    degree = plan.parallel.pipeline.stages if name == "pipeline" else plan.parallel.tensor.degree
    assert degree == 2 and plan.data_parallel_size == 1
    if name == "pipeline":
        losses = _losses(pipeline_log)
    else:
        _train(plans[name], work / f"{name}.json", "--stop-at", PARALLEL_STEPS)
        losses = _losses(work / f"{name}.json")
    data_losses = _losses(data_log)[:PARALLEL_STEPS]
    assert len(losses) == PARALLEL_STEPS and all(math.isfinite(loss) for loss in losses)
    for a, b in zip(losses, data_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, data_losses)


def test_a_pipeline_plan_saves_and_resumes_exactly(plans, pipeline_log, work):
    """Stopped at step 2 with a checkpoint (one file per stage's rank), resumed to the end: the
    uninterrupted pipeline run's losses, bitwise."""
    assert load_plan(plans["pipeline"]).training.grad_accum_steps >= 2  # micro-batches in flight between stages
    checkpoint, first_log, second_log = work / "pipeline-ckpt", work / "pipeline-a.json", work / "pipeline-b.json"
    _train(plans["pipeline"], first_log, "--stop-at", PIPELINE_SAVE_AT, "--save", checkpoint)
    saved = sorted(p.name for p in checkpoint.glob(f"step-{PIPELINE_SAVE_AT:06d}/rank-*.pt"))
    assert saved == ["rank-00000.pt", "rank-00001.pt"]
    second = _train(plans["pipeline"], second_log, "--stop-at", PARALLEL_STEPS, "--resume", checkpoint)
    assert "weights only" not in second.stdout + second.stderr
    assert _losses(first_log) + _losses(second_log) == _losses(pipeline_log)
