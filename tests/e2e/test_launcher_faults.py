"""Faults around a running job, with real elixir-run processes and gloo workers: the launcher
killed with SIGKILL, a rendezvous port held by another program, a node that never comes, a worker
stopped with SIGSTOP, a worker hung in its own code. Each must end with a message naming the cause
within its configured bound (short bounds here), and leave no worker behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from tests.e2e.launch_helpers import (
    ALLREDUCE_WORKER,
    EXAMPLE_PLAN,
    WORKERS_DIR,
    alive,
    finish_all,
    finish_elixir,
    free_port,
    kill_leftovers,
    run_elixir,
    start_elixir,
    wait_for_ranks,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COMM_WORKER = WORKERS_DIR / "engine_comm_worker.py"


def _started(process: subprocess.Popen, out_dir, ranks: int) -> list[dict]:
    """The ranks' start-up records; the job's output in the failure when it ended instead."""
    try:
        return wait_for_ranks(out_dir, ranks, timeout_s=90)
    except AssertionError:
        if process.poll() is None:
            process.kill()
        pytest.fail(f"workers did not start; elixir-run said:\n{process.communicate()[0]}")


def _gone_within(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def test_a_rendezvous_port_held_by_another_program_is_an_error_at_once(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(4)  # accepts connections, never answers: not a rendezvous store
        port = holder.getsockname()[1]
        started = time.monotonic()
        result = run_elixir(
            ["--rdzv-endpoint", f"127.0.0.1:{port}", EXAMPLE_PLAN, ALLREDUCE_WORKER, "--out", tmp_path], timeout_s=60
        )
        took_s = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"rendezvous port {port} (127.0.0.1:{port}) is held by another program" in result.stderr
    assert "choose another port with --rdzv-endpoint" in result.stderr
    assert took_s < 40  # start-up (torch import) plus the 3 s probe; was minutes of silence
    assert not list(tmp_path.iterdir()), "workers started"


def _hang_up_on_everyone(holder: socket.socket) -> None:
    """Accepts each connection and closes it at once, as a program that rejects what it does not know."""
    while True:
        try:
            connection, _ = holder.accept()
        except OSError:  # the test closed the socket
            return
        connection.close()


def test_a_rendezvous_port_whose_program_hangs_up_is_one_line_without_cpp_frames(tmp_path):
    """A TCPStore client retried against it, printing a page of C++ frames per try, and the process sometimes
    ended in SIGABRT ('terminate called without an active exception') after the right line."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(16)
        port = holder.getsockname()[1]
        threading.Thread(target=_hang_up_on_everyone, args=(holder,), daemon=True).start()
        result = run_elixir(
            ["--rdzv-endpoint", f"127.0.0.1:{port}", EXAMPLE_PLAN, ALLREDUCE_WORKER, "--out", tmp_path], timeout_s=60
        )
        holder.shutdown(socket.SHUT_RDWR)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert f"error: rendezvous port {port} (127.0.0.1:{port}) is held by another program" in result.stderr
    assert "choose another port with --rdzv-endpoint" in result.stderr
    assert "frame #" not in output and "TCPStore" not in output and "terminate called" not in output, output
    assert not list(tmp_path.iterdir()), "workers started"


def test_a_stopped_worker_is_named_and_the_job_ends(tmp_path):
    timeout_s = 4
    process = start_elixir(["--collective-timeout", timeout_s, EXAMPLE_PLAN, COMM_WORKER, "--out", tmp_path])
    pids: list[int] = []
    try:
        records = _started(process, tmp_path, 2)
        pids = [record["pid"] for record in records]
        assert [record["timeout_s"] for record in records] == [timeout_s, timeout_s]
        stopped_at = time.monotonic()
        os.kill(pids[1], signal.SIGSTOP)
        output = finish_elixir(process, timeout_s=60)
        ended_s = time.monotonic() - stopped_at
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0, output
    assert f"rank 1 (pid {pids[1]}) has been stopped for" in output  # said while it happened
    assert f"rank 1 (local rank 1, pid {pids[1]}) was killed by SIGKILL (was stopped (SIGSTOP)" in output
    assert "out-of-memory" not in output
    assert ended_s < timeout_s + 20, f"ended {ended_s:.0f} s after the stop"
    assert _gone_within(pids, 5), "worker processes outlived the job"


def test_a_hung_worker_is_named_after_the_collective_timeout(tmp_path):
    timeout_s = 4
    process = start_elixir(
        ["--collective-timeout", timeout_s, EXAMPLE_PLAN, COMM_WORKER, "--out", tmp_path, "--hang-rank", "1"]
    )
    pids: list[int] = []
    try:
        pids = [record["pid"] for record in _started(process, tmp_path, 2)]
        started = time.monotonic()
        output = finish_elixir(process, timeout_s=90)
        ended_s = time.monotonic() - started
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0, output
    # Rank 0 timed out in the engine's collective; rank 1, stopped by the agent afterwards, is named.
    assert (
        f"worker rank 1 (local rank 1, pid {pids[1]}) was killed by SIGTERM (it stopped answering: rank(s) 0 timed out"
        in output
    )
    assert ended_s < timeout_s + 45
    assert _gone_within(pids, 5), "worker processes outlived the job"


def test_a_node_that_never_comes_is_named_by_every_waiting_node(tmp_path):
    """Two nodes of four start (loopback); both give up after --rdzv-timeout naming nodes 2 and 3."""
    from tests.e2e.launch_helpers import write_plan

    plan = write_plan(tmp_path / "plan.yaml", {"cluster.nodes": 4, "training.global_batch_size": 64})
    out = tmp_path / "out"
    out.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        start_elixir(
            ["--nnodes", 4, "--node-rank", rank, "--rdzv-endpoint", endpoint, "--rdzv-timeout", 4]
            + [plan, ALLREDUCE_WORKER, "--out", out]
        )
        for rank in (0, 1)
    ]
    outputs = finish_all(nodes, timeout_s=90)
    assert [node.returncode for node in nodes] == [1, 1], outputs
    # On loopback either node may serve the store (the first to bind the port); the server gives up
    # after --rdzv-timeout, the other then too, or when it sees the store close.
    assert any(f"rendezvous at {endpoint}: 2 of 4 nodes joined within 4 s" in output for output in outputs), outputs
    for output in outputs:
        assert f"rendezvous at {endpoint}: " in output and "missing: node 2, node 3 (joined: node " in output, output
        assert f"waiting at {endpoint}" in output  # the line each node printed while it waited
    assert not list(out.iterdir()), "workers started without every node"


def test_kill_9_of_node_0s_elixir_run_ends_the_job_on_every_node(tmp_path):
    """Two nodes on loopback: node 0's workers die with their launcher; node 1's lose their peers
    and the rendezvous store, and node 1's elixir-run ends the job there with a message."""
    from tests.e2e.launch_helpers import write_plan

    plan = write_plan(tmp_path / "plan.yaml", {"cluster.nodes": 2, "training.global_batch_size": 32})
    out = tmp_path / "out"
    out.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        start_elixir(
            ["--nnodes", 2, "--node-rank", rank, "--rdzv-endpoint", endpoint, plan, ALLREDUCE_WORKER]
            + ["--out", out, "--iterations", 0]
        )
        for rank in (0, 1)
    ]
    pids: list[int] = []
    try:
        records = _started(nodes[1], out, 4)
        pids = [record["pid"] for record in records]
        assert sorted(record["rank"] for record in records) == [0, 1, 2, 3]
        assert all(record["world_size"] == 4 and record["plan"] == str(plan) for record in records)
        nodes[0].kill()
        assert _gone_within(pids, 10), "workers outlived node 0's SIGKILLed elixir-run by 10 s"
        output = finish_elixir(nodes[1], timeout_s=60)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
        assert not kill_leftovers(pids)
    assert nodes[1].returncode != 0, output
    assert "error: " in output
