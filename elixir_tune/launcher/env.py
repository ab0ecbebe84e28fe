"""The environment elixir-run gives its workers."""

from __future__ import annotations

import os
from collections.abc import Mapping

from elixir_tune.cpu_binding import CPU_BIND_ENV
from elixir_tune.plan import PLAN_ENV_VAR, Plan

# For the workers' bootstrap (worker_main): elixir-run's pid, and the job's run directory.
LAUNCHER_PID_ENV = "ELIXIR_TUNE_LAUNCHER_PID"
RUN_DIR_ENV = "ELIXIR_TUNE_RUN_DIR"

# Read by engine/worker.py (collective_timeout_s), which keeps its own copy of the name: the engine
# does not import the launcher.
COLLECTIVE_TIMEOUT_ENV = "ELIXIR_TUNE_COLLECTIVE_TIMEOUT_S"

# torchrun's agent shares its rendezvous store with the workers and keeps it across restarts, so a
# restarted gloo group reads the dead group's addresses from it and fails in connectFullMesh
# ("Connection refused"). With sharing off, each round's rank 0 hosts a fresh store on a free port.
FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def worker_env(
    plan: Plan,
    plan_path: str | os.PathLike,
    cpu_cores: int,
    current: Mapping[str, str],
    collective_timeout_s: float | None = None,
    max_restarts: int = 0,
) -> dict[str, str]:
    """Variables to export before torchrun starts the workers (they inherit them).

    Args:
        plan: the plan.
        plan_path: the plan's file; exported as an absolute path so a worker that changes
            directory still finds it.
        cpu_cores: cores of this node.
        current: the current environment; a variable the user already set is kept.
        collective_timeout_s: how long a collective waits for the other ranks (the engine's
            process-group timeout); None leaves the engine's default.
        max_restarts: torchrun's restarts of the worker group; above 0, each round gets a store of its own.

    Returns:
        Only the variables to set.
    """
    env = {PLAN_ENV_VAR: os.path.abspath(plan_path)}
    # Each worker gets its share of the cores: cpu plans compute there, cuda plans run the CPU
    # optimizer for offloaded chunks there. torchrun's own default (1 thread) starves both.
    if "OMP_NUM_THREADS" not in current:
        env["OMP_NUM_THREADS"] = str(max(1, cpu_cores // plan.cluster.gpus_per_node))
    # CPU plans: each worker on its own cores (``elixir_tune/cpu_binding.py``: left to the kernel, a
    # pipeline's two workers can share one core for a whole run). worker_main binds; "0" opts out.
    if plan.cluster.device == "cpu" and CPU_BIND_ENV not in current:
        env[CPU_BIND_ENV] = "1"
    if collective_timeout_s is not None:
        env[COLLECTIVE_TIMEOUT_ENV] = f"{collective_timeout_s:g}"
    if max_restarts > 0 and FRESH_STORE_ENV not in current:
        env[FRESH_STORE_ENV] = "1"
    return env


def bootstrap_env(run_dir: str | os.PathLike) -> dict[str, str]:
    """What only a real launch exports, for the workers' bootstrap (worker_main): this process's pid
    (the workers die with it) and the job's run directory (their pids and errors, for the watch)."""
    return {LAUNCHER_PID_ENV: str(os.getpid()), RUN_DIR_ENV: str(run_dir)}
