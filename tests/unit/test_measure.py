"""Measuring plans (elixir_tune/measure): the calibrated hardware scales every prediction by one factor, and
the trials keep to their budget and leave out plans that cannot run, without starting a process."""

from __future__ import annotations

from pathlib import Path

import pytest

from elixir_tune.costmodel.model import CostModel
from elixir_tune.costmodel.peers import PeerModel, PeerShape
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.hardware.spec import load_hardware_file, save_hardware
from elixir_tune.measure.calibrate import calibrated, spread, time_factor
from elixir_tune.measure.trials import Trial, measure
from elixir_tune.plan.engine_choice import EngineChoice
from elixir_tune.search import search


@pytest.fixture(scope="module")
def profile():
    return gpt2_profile("g", hidden=256, layers=4, heads=4, vocab=256, positions=128, seq_len=128, dtype="fp32")


@pytest.mark.parametrize("preset", ["cpu", "a100-40gb-pcie"])
def test_calibration_scales_every_prediction_by_its_factor(profile, preset, tmp_path: Path):
    hardware = load_hardware(preset)
    save_hardware(calibrated(hardware, 2.5, "a test"), tmp_path / "hw.yaml")
    slower = load_hardware_file(tmp_path / "hw.yaml")
    assert "a test" in slower.sources["calibrated"]
    before = search(profile, hardware, gpus_per_node=2, global_batch_size=8)
    after = search(profile, slower, gpus_per_node=2, global_batch_size=8)
    assert after.candidates[0].step_time_s == pytest.approx(2.5 * before.candidates[0].step_time_s, rel=1e-6)
    assert after.plan.prediction.peak_gpu_bytes == before.plan.prediction.peak_gpu_bytes
    shape = PeerShape(EngineChoice("deepspeed", zero_stage=3, offload_optimizer=True), 2, 2, 1)
    peer = [PeerModel(CostModel(profile, hw, 2)).step_time(shape).step_time_s for hw in (hardware, slower)]
    assert peer[1] == pytest.approx(2.5 * peer[0], rel=1e-9)


def test_the_factor_is_the_median_ratio_and_the_spread_what_it_leaves():
    assert time_factor([2.0, 4.0, 3.0]) == 3.0
    assert spread([2.0, 4.0, 3.0], 3.0) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="nothing to calibrate"):
        time_factor([])


def _trial(tmp_path: Path, **kwargs) -> Trial:
    return Trial("t", tmp_path / "plan.yaml", ["pretrain", "--synthetic"], 0.1, 1 << 20, **kwargs)


def test_no_trial_starts_past_the_budget(tmp_path: Path):
    lines: list[str] = []
    done = measure([_trial(tmp_path)], steps=3, warmup=1, rounds=2, budget_s=1, work_dir=tmp_path, say=lines.append)
    assert done.rounds_done == 0 and done.results[0].wall_s == []
    assert done.stopped.startswith("budget: t's next trial would take about")
    assert done.fastest(lambda result: True) is None


def test_a_plan_that_cannot_run_is_left_out_with_its_reason(tmp_path: Path):
    lines: list[str] = []
    trial = _trial(tmp_path, engine="fsdp2", skip_reason="engine fsdp2's runner is missing")
    done = measure([trial], steps=3, warmup=1, rounds=1, budget_s=60, work_dir=tmp_path, say=lines.append)
    assert lines == ["skipped t: engine fsdp2's runner is missing"]
    assert done.results[0].failure == "engine fsdp2's runner is missing" and done.results[0].wall_s == []


def test_steps_must_exceed_the_warm_up(tmp_path: Path):
    with pytest.raises(ValueError, match="must exceed the 1 warm-up"):
        measure([_trial(tmp_path)], steps=1, warmup=1, rounds=1, budget_s=60, work_dir=tmp_path)
