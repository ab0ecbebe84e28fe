"""The user's path with pipeline and tensor parallelism: profile -> search --fix pipeline=2 (or tensor=2)
-> elixir-run PLAN pretrain on 2 CPU workers. Each searched plan trains with the same per-step
losses as the searched data-parallel plan of the same global batch (fp32, same seed and data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elixir_tune.plan import load_plan
from tests.e2e.launch_helpers import run_elixir, tune

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # torchrun with several worker processes

STEPS = 4


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("parallel") / "profile.yaml"
    tune(["profile", "configs/models/gpt2-tiny.yaml", "--batch-size", "4", "--seq-len", "64", "--out", path])
    return path


def _train(profile: Path, tmp_path: Path, name: str, pins: list[str]) -> list[float]:
    plan = tmp_path / f"{name}.yaml"
    fixes = [arg for pin in pins for arg in ("--fix", pin)]
    tune(
        [
            "search",
            "--gpus",
            "2",
            "--hardware",
            "cpu",
            "--profile",
            profile,
            "--global-batch-size",
            "8",
            "--loop",
            "forward_backward",
            *fixes,
            "--out",
            plan,
        ]
    )
    log = tmp_path / f"{name}.json"
    result = run_elixir([plan, "pretrain", "--steps", STEPS, "--seed", "5", "--log", log], timeout_s=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [step["loss"] for step in json.loads(log.read_text())["steps"]]


@pytest.fixture(scope="module")
def data_losses(profile, tmp_path_factory) -> list[float]:
    """The searched data-parallel plan's losses (trained once for both parallel plans)."""
    return _train(profile, tmp_path_factory.mktemp("data"), "data", ["pipeline=1", "tensor=1"])


@pytest.mark.parametrize("pin", ["pipeline=2", "tensor=2"])
def test_a_searched_parallel_plan_trains_like_data_parallel(profile, data_losses, tmp_path, pin):
    losses = _train(profile, tmp_path, "parallel", [pin])
    plan = load_plan(tmp_path / "parallel.yaml")
    degree = plan.parallel.pipeline.stages if pin.startswith("pipeline") else plan.parallel.tensor.degree
    assert degree == 2 and plan.data_parallel_size == 1
    assert len(losses) == STEPS
    for a, b in zip(losses, data_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, data_losses)
