"""Real elixir-run jobs with plain torch.distributed workers (gloo, CPU): success, exit status,
a worker killed with SIGKILL, Ctrl-C and SIGTERM. Each job is bounded in time and every worker pid is
checked to be gone afterwards. Two nodes on loopback: test_launcher_faults.py (4 workers start with
their ranks, the rendezvous gives up on missing nodes) and test_pipeline.py (a two-node job trains)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from elixir_tune.launcher.checks import cpu_cores
from tests.e2e.launch_helpers import (
    ALLREDUCE_WORKER,
    EXAMPLE_PLAN,
    finish_elixir,
    kill_leftovers,
    run_elixir,
    start_elixir,
    wait_for_ranks,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # torchrun with several worker processes


def test_job_runs_with_the_plans_world_and_environment(tmp_path):
    result = run_elixir([EXAMPLE_PLAN, ALLREDUCE_WORKER, "--out", tmp_path, "--iterations", "3"])
    assert result.returncode == 0, result.stdout + result.stderr
    records = wait_for_ranks(tmp_path, 2, timeout_s=1)
    assert [record["world_size"] for record in records] == [2, 2]
    assert all(record["plan"] == str(EXAMPLE_PLAN) for record in records)
    assert all(record["omp_num_threads"] == str(max(1, cpu_cores() // 2)) for record in records)
    assert all(record["argv"] == ["--out", str(tmp_path), "--iterations", "3"] for record in records)
    # sum over 3 iterations of all-reduce(1 + 2) = 9 on both ranks: the workers really talked.
    assert all((tmp_path / f"done{rank}.json").exists() for rank in range(2))
    assert "job finished" in result.stdout


def test_the_failed_workers_exit_code_is_the_jobs(tmp_path):
    result = run_elixir([EXAMPLE_PLAN, ALLREDUCE_WORKER, "--out", tmp_path, "--fail-rank", "1", "--exit-code", "7"])
    assert result.returncode == 7, result.stdout + result.stderr
    assert "rank 1 (local rank 1" in result.stderr and "exited with code 7" in result.stderr
    pids = [record["pid"] for record in wait_for_ranks(tmp_path, 2, timeout_s=1)]
    assert not kill_leftovers(pids)


def test_sigkill_of_one_worker_ends_the_job(tmp_path):
    process = start_elixir([EXAMPLE_PLAN, ALLREDUCE_WORKER, "--out", tmp_path, "--iterations", "0"])
    try:
        records = wait_for_ranks(tmp_path, 2, timeout_s=90)
        pids = [record["pid"] for record in records]
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        output = finish_elixir(process, timeout_s=60)
        ended_s = time.monotonic() - killed_at
    finally:
        if process.poll() is None:
            process.kill()
    assert ended_s < 60
    assert process.returncode != 0 and process.returncode == 128 + signal.SIGKILL, output
    assert f"rank 1 (local rank 1, pid {pids[1]}) was killed by SIGKILL" in output
    time.sleep(0.2)
    assert not kill_leftovers(pids), "worker processes outlived the job"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_elixir_run_stops_the_job_cleanly(tmp_path, sig):
    process = start_elixir([EXAMPLE_PLAN, ALLREDUCE_WORKER, "--out", tmp_path, "--iterations", "0"])
    try:
        pids = [record["pid"] for record in wait_for_ranks(tmp_path, 2, timeout_s=90)]
        sent_at = time.monotonic()
        # Ctrl-C (SIGINT) reaches only elixir-run: torchrun starts the workers in their own sessions.
        process.send_signal(sig)
        output = finish_elixir(process, timeout_s=60)
        ended_s = time.monotonic() - sent_at
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + sig, output
    assert f"interrupted by {sig.name}; the workers were stopped" in output
    assert ended_s < 30
    time.sleep(0.2)
    assert not kill_leftovers(pids), "worker processes outlived the job"
