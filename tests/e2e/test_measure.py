"""`elixir-tune bench` and `elixir-tune search --measure` through real elixir-run processes (gloo, 2 CPU workers):
measured step time and memory beside the prediction, the measured fastest written, a recalibrated hardware file."""

from __future__ import annotations

import json
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from elixir_tune.hardware.spec import load_hardware_file
from elixir_tune.plan import load_plan
from tests.e2e.launch_helpers import console_script, job_env, tune

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture
def searched(tmp_path):
    tune(["profile", "gpt2-tiny", "-b", 2, "-s", 64], tmp_path)
    return tmp_path


def test_bench_runs_a_plan_and_sets_measured_beside_predicted(searched):
    tune(["search", "--gpus", 2, "--hardware", "cpu", "--global-batch-size", 4], searched)
    out = tune(["bench", "plan.yaml", "--steps", 2, "--rounds", 1, "--json", "bench.json"], searched).output
    record = json.loads((searched / "bench.json").read_text())
    (row,) = record["plans"]
    assert row["status"] == "ran" and row["timed_steps"] == 1, out
    assert row["predicted_step_time_s"] == load_plan(searched / "plan.yaml").prediction.step_time_s
    assert row["measured_step_time_s"] > 0 and row["measured_peak_bytes"] > 0
    assert f"{row['measured_step_time_s'] * 1000:.1f}" in out


@pytest.mark.heavy
def test_search_measure_writes_the_measured_fastest_within_its_budget(searched):
    budget = 240
    out = tune(
        ["search", "--gpus", 2, "--hardware", "cpu", "--global-batch-size", 4, "--measure", "--measure-top", 2]
        + ["--measure-steps", 3, "--measure-rounds", 2, "--measure-budget", budget],
        searched,
    ).output
    record = json.loads((searched / "plan.measured.json").read_text())
    assert record["elapsed_s"] <= budget + 15, out  # a running trial is stopped at the budget (10 s grace)
    ran = [row for row in record["plans"] if row["status"] == "ran"]
    assert ran, out
    fastest = min(ran, key=lambda row: row["measured_step_time_s"])
    assert record["chosen"] == fastest["name"]
    assert load_plan(searched / "plan.yaml") == load_plan(searched / fastest["plan"])
    # the peers' nearest configurations are listed, and left out with the reason while their runners are missing
    peers = [row for row in record["plans"] if row["engine"] != "elixir"]
    assert {row["engine"] for row in peers} == {"fsdp2", "deepspeed"}
    assert all(row["status"] == "ran" or "runner" in row["status"] for row in peers), peers
    hardware = load_hardware_file(searched / "plan.hardware.yaml")
    assert hardware.sources["calibrated"] and record["time_factor"] > 0
    assert f"steps ran {record['time_factor']:.2f}x the predicted time" in out


@pytest.mark.heavy
def test_ctrl_c_stops_the_running_trial_and_keeps_what_was_measured(searched):
    tune(["search", "--gpus", 2, "--hardware", "cpu", "--global-batch-size", 4], searched)
    command = [console_script("elixir-tune"), "bench", "plan.yaml", "--steps", 400, "--json", "bench.json"]
    process = subprocess.Popen(
        [str(arg) for arg in command],
        cwd=searched,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=job_env(),
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    logs = []
    while not logs and time.monotonic() < deadline:  # the trial's log appears once a step is done
        time.sleep(0.5)
        logs = [path for path in Path(tempfile.gettempdir()).glob("elixir-measure-*/trial-0-round-0.json")]
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output[-3000:]
    assert "stopped early: interrupted (Ctrl-C): the results so far are kept" in output
    (row,) = json.loads((searched / "bench.json").read_text())["plans"]
    assert row["timed_steps"] >= 0 and row["status"] in ("ran", "not run")
    assert logs, output[-3000:]
    time.sleep(2)
    workers = subprocess.run(["pgrep", "-f", str(logs[0])], capture_output=True, text=True).stdout
    assert workers.strip() == "", "the trial's processes outlived the stop"
