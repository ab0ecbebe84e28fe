"""CPU workers on cores of their own (elixir_tune/cpu_binding.py): the split, the opt-out, the real binding."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from elixir_tune.cpu_binding import CPU_BIND_ENV, bind_cpu_worker, binding_preexec, core_share, worker_cores
from elixir_tune.launcher.env import worker_env
from elixir_tune.paths import CONFIGS_DIR
from elixir_tune.plan import load_plan

HAS_AFFINITY = hasattr(os, "sched_setaffinity")


def test_core_share_gives_each_worker_consecutive_cores_of_its_own():
    allowed = [0, 1, 2, 3, 4, 5, 6, 7]
    shares = [core_share(allowed, rank, 4) for rank in range(4)]
    assert shares == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # Unordered and sparse sets (a cgroup or taskset mask) are split the same way; a remainder goes unused.
    assert [core_share([9, 3, 5], rank, 2) for rank in range(2)] == [[3], [5]]


def test_core_share_leaves_workers_unbound_with_fewer_cores_than_workers():
    assert core_share([0, 1], 2, 4) == [0, 1]


def test_core_share_refuses_a_rank_outside_the_node():
    with pytest.raises(ValueError, match="local rank 2 is not one of 2 workers"):
        core_share([0, 1], 2, 2)


def test_binding_is_asked_only_for_cpu_plans_and_the_user_can_opt_out():
    plan = load_plan(CONFIGS_DIR / "plans" / "example.yaml")
    cuda = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, device="cuda"))
    assert CPU_BIND_ENV not in worker_env(cuda, "plan.yaml", 8, {})
    cpu = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, device="cpu"))
    assert worker_env(cpu, "plan.yaml", 8, {})[CPU_BIND_ENV] == "1"
    assert CPU_BIND_ENV not in worker_env(cpu, "plan.yaml", 8, {CPU_BIND_ENV: "0"})


def test_nothing_is_bound_without_the_variable_or_with_one_worker():
    assert bind_cpu_worker({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}) is None
    assert bind_cpu_worker({CPU_BIND_ENV: "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}) is None
    assert bind_cpu_worker({CPU_BIND_ENV: "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}) is None
    assert worker_cores(0, 1) is None


@pytest.mark.skipif(not HAS_AFFINITY or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores and sched_setaffinity")
def test_a_bound_child_and_the_threads_it_starts_stay_on_its_share():
    allowed = sorted(os.sched_getaffinity(0))
    # A child of the second of 2 workers, as the probe starts its workers; it starts a thread and reports both masks.
    code = (
        "import json, os, threading; out = []\n"
        "t = threading.Thread(target=lambda: out.append(sorted(os.sched_getaffinity(0)))); t.start(); t.join()\n"
        "print(json.dumps([sorted(os.sched_getaffinity(0)), out[0]]))"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, preexec_fn=binding_preexec(1, 2)
    )
    second = core_share(allowed, 1, 2)
    assert json.loads(child.stdout) == [second, second]
    # The launcher's path (worker_main): the worker binds itself from the environment elixir-run exports.
    env = {**os.environ, CPU_BIND_ENV: "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    code = (
        "import json, os; from elixir_tune.cpu_binding import bind_cpu_worker\n"
        "print(json.dumps([bind_cpu_worker(), sorted(os.sched_getaffinity(0))]))"
    )
    worker = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    first = core_share(allowed, 0, 2)
    assert json.loads(worker.stdout) == [first, first]
    assert set(first).isdisjoint(second)


@pytest.mark.skipif(not HAS_AFFINITY or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores and sched_setaffinity")
def test_elixir_runs_worker_bootstrap_binds_before_the_script_runs(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    script = tmp_path / "train.py"
    script.write_text("import json, os\nprint(json.dumps(sorted(os.sched_getaffinity(0))))\n")
    env = {**os.environ, CPU_BIND_ENV: "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "RANK": "1"}
    for key in ("ELIXIR_TUNE_LAUNCHER_PID", "ELIXIR_TUNE_RUN_DIR"):
        env.pop(key, None)
    bound = subprocess.run(
        [sys.executable, "-m", "elixir_tune.launcher.worker_main", str(script)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    assert json.loads(bound.stdout) == core_share(allowed, 1, 2)
    free = subprocess.run(
        [sys.executable, "-m", "elixir_tune.launcher.worker_main", str(script)],
        capture_output=True,
        text=True,
        check=True,
        env={**env, CPU_BIND_ENV: "0"},
    )
    assert json.loads(free.stdout) == allowed


def test_the_opt_out_leaves_the_probes_workers_unbound_too():
    # A user who sets ELIXIR_TUNE_CPU_BIND=0 runs unbound workers; the probe must measure the same.
    assert binding_preexec(0, 2, env={CPU_BIND_ENV: "0"}) is None
    if HAS_AFFINITY and len(os.sched_getaffinity(0)) >= 2:
        assert binding_preexec(0, 2, env={}) is not None
