"""The probe notices a loaded machine (``hardware/load.py``): busy loops this test starts and stops make
the quick probe refuse before it measures, say so, and record the load when told to go on; ``search``
warns about a file measured under load."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from elixir_tune.cli.console import err_console
from elixir_tune.cli.main import cli
from elixir_tune.cli.probe import LoadedMachine, measure_when_idle
from elixir_tune.cli.search import warn_loaded_hardware
from elixir_tune.hardware import load_hardware, spec_problems
from elixir_tune.hardware.load import (
    BUSY_SHARE_LOADED,
    CpuTimes,
    LoadSample,
    judge,
    load_record,
    sample_load,
)


@pytest.fixture
def busy_machine():
    """One spinning Python process per core (and one more), killed however the test ends."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range((os.cpu_count() or 1) + 1)]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def _sample(busy_share: float = 0.0, steal: int = 0, total: int = 1000, reference_s: float = 0.01) -> LoadSample:
    return LoadSample(0.5, busy_share, 2, [reference_s] * 9, CpuTimes(busy=0, steal=steal, total=total))


def test_judge_reads_busy_cores_steal_and_drift():
    assert judge(_sample(), _sample(steal=10, total=2000)) == []  # 1% stolen: idle
    assert "stole 20%" in judge(_sample(), _sample(steal=200, total=2000))[0]
    busy = judge(_sample(busy_share=BUSY_SHARE_LOADED + 0.1), _sample())
    assert len(busy) == 1 and "other processes kept 0.7 of 2 cores busy" in busy[0]
    assert "2.00x as long after" in judge(_sample(), _sample(reference_s=0.02))[0]
    assert load_record(_sample(busy_share=0.5), _sample())["loaded"] == 1.0


@pytest.mark.slow
def test_quick_probe_on_a_busy_machine_refuses_and_says_what_it_saw(busy_machine):
    result = CliRunner().invoke(cli, ["probe", "--quick", "--load-retries", "0", "--out", "/nonexistent/hw.yaml"])
    assert result.exit_code == 1, result.output
    assert "the machine is loaded by other work" in result.stderr
    assert "cores busy" in result.stderr and "--allow-loaded" in result.stderr


@pytest.mark.slow
def test_loaded_measurement_is_retried_then_recorded(busy_machine):
    said: list[str] = []
    preset = load_hardware("cpu")
    measured = []

    def measure():
        measured.append(1)
        return preset

    with pytest.raises(LoadedMachine, match="cores busy"):
        measure_when_idle(measure, retries=1, allow_loaded=False, say=said.append, wait_s=0.1)
    assert len(said) == 1 and "waiting" in said[0] and not measured  # refused before measuring
    spec, reasons = measure_when_idle(measure, retries=0, allow_loaded=True, say=said.append)
    assert reasons and measured and spec.measured_under_load and spec_problems(spec) == []
    assert spec.probe_load["busy_cores_before"] >= BUSY_SHARE_LOADED * spec.probe_load["cores"]
    assert "probe_load" in spec.sources


def test_search_warns_about_a_file_measured_under_load():
    spec = load_hardware("cpu")
    idle_record = load_record(_sample(), _sample())
    with err_console.capture() as quiet:
        warn_loaded_hardware(dataclasses.replace(spec, probe_load=idle_record), "hw.yaml")
    assert quiet.get() == ""
    with err_console.capture() as loud:
        warn_loaded_hardware(dataclasses.replace(spec, probe_load=load_record(_sample(0.9), _sample())), "hw.yaml")
    assert "hw.yaml: it was measured on a loaded machine" in loud.get()


def test_sample_load_reads_this_machine():
    sample = sample_load(window_s=0.1)
    assert 0 <= sample.busy_share <= 1 and sample.cores >= 1 and sample.reference_spread >= 1
