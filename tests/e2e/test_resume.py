"""An interrupted elixir-run job loses nothing: Ctrl-C saves a sharded checkpoint, --resume goes on.

Three real jobs of the pretrain recipe on 2 CPU workers (gloo) with the example plan made
runnable (the tiny GPT-2's real fingerprint): a straight run of 20 steps; a run with --save that
gets SIGINT after its first logged step (every rank finishes the step, saves, exits 130); and a
--resume run to step 20. The per-step losses and learning rates of interrupted + resumed equal the
straight run's exactly (same data sampler, same LR schedule, bitwise optimizer state).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from elixir_tune.paths import REPO_DIR
from tests.e2e.launch_helpers import console_script, job_env, run_elixir, write_plan

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # torchrun with several worker processes

TRAIN = "pretrain"  # the recipe name: elixir-run runs elixir_tune/recipes/pretrain.py
MODEL = REPO_DIR / "configs" / "models" / "gpt2-tiny.yaml"
STEPS = 20


def _runnable_plan(path: Path) -> Path:
    import torch

    from elixir_tune.engine import model_fingerprint
    from elixir_tune.profiler import load_model_source

    torch.manual_seed(0)
    model = load_model_source(str(MODEL)).build_model()
    return write_plan(path, {"model.fingerprint": model_fingerprint(model), "model.source": str(MODEL)})


def _steps(log: Path) -> list[tuple[int, float, float]]:
    return [(s["step"], s["loss"], s["lr"]) for s in json.loads(log.read_text())["steps"]]


def _logged_steps(log: Path) -> int:
    try:
        return len(json.loads(log.read_text())["steps"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


def test_sigint_saves_and_resume_continues_exactly(tmp_path):
    plan = _runnable_plan(tmp_path / "plan.yaml")
    common = [plan, TRAIN, "--steps", "200"]  # the schedule of a long run; --stop-at ends it early
    straight = run_elixir([*common, "--stop-at", STEPS, "--log", tmp_path / "a.json"])
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]

    checkpoint, log_b = tmp_path / "ckpt", tmp_path / "b.json"
    process = subprocess.Popen(
        [console_script("elixir-run"), *map(str, [*common, "--save", checkpoint, "--log", log_b])],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=job_env(),
        cwd=REPO_DIR,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while _logged_steps(log_b) < 1 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        output = process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGINT, output[-3000:]
    record = json.loads(log_b.read_text())
    assert record["summary"]["status"] == "interrupted"
    interrupted = _steps(log_b)
    saved = checkpoint / (checkpoint / "latest").read_text().strip()  # checkpoint/step-NNNNNN
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["step"] == len(interrupted) and 1 <= meta["step"] < STEPS, (meta, output[-2000:])
    assert meta["world_size"] == 2 and meta["extra"]["steps"] == 200
    assert saved.name == f"step-{meta['step']:06d}" and set(meta["files"]) == {
        "model.pt",
        "rank-00000.pt",
        "rank-00001.pt",
    }

    resumed = run_elixir([*common, "--stop-at", STEPS, "--resume", checkpoint, "--log", tmp_path / "c.json"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {checkpoint} at step {meta['step']}" in resumed.stdout
    record = json.loads((tmp_path / "c.json").read_text())
    assert record["resumed_from"]["step"] == meta["step"]
    assert interrupted + _steps(tmp_path / "c.json") == _steps(tmp_path / "a.json")
