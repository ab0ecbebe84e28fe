"""The environment elixir-run gives its workers."""

from __future__ import annotations

import os
from collections.abc import Mapping

from elixir_tune.plan import PLAN_ENV_VAR, Plan


def worker_env(plan: Plan, plan_path: str | os.PathLike, cpu_cores: int, current: Mapping[str, str]) -> dict[str, str]:
    """Variables to export before torchrun starts the workers (they inherit them).

    Args:
        plan: the plan.
        plan_path: the plan's file; exported as an absolute path so a worker that changes
            directory still finds it.
        cpu_cores: cores of this node.
        current: the current environment; a variable the user already set is kept.

    Returns:
        Only the variables to set.
    """
    env = {PLAN_ENV_VAR: os.path.abspath(plan_path)}
    # Each worker gets its share of the cores: cpu plans compute there, cuda plans run the CPU
    # optimizer for offloaded chunks there. torchrun's own default (1 thread) starves both.
    if "OMP_NUM_THREADS" not in current:
        env["OMP_NUM_THREADS"] = str(max(1, cpu_cores // plan.cluster.gpus_per_node))
    return env
