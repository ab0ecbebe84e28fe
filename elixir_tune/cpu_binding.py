"""Each CPU worker on cores of its own: the binding elixir-run, the probe and its engine measurement share.

When the CPU is the device, a node's workers are its compute: each runs ``OMP_NUM_THREADS`` = its
share of the cores. Left to the kernel, two workers that hand work to each other (a pipeline's stages:
one sends its activations, the other wakes to receive them) are woken onto the sender's core, and
on a machine with other load the kernel's balancer may leave them there: both workers then share one
core for a whole run, and a pipeline-2 step of the bench's GPT-2 on 2 cores took 517 ms in one run
and 285 ms in the next (benchmarks/results/prediction-cpu-layouts-idle-run2.md, in git at 4ecf109). Bound to disjoint
cores, as torchrun's and Intel's launchers bind CPU workers, each worker always has its own core.

No torch: ``launcher/worker_main.py`` binds before the user's script imports torch, so every thread
torch starts inherits the worker's cores.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence

# Exported by elixir-run for CPU plans (``launcher/env.py``); "0" (set by the user) leaves the workers
# wherever the kernel puts them.
CPU_BIND_ENV = "ELIXIR_TUNE_CPU_BIND"


def core_share(allowed: Sequence[int], local_rank: int, local_world: int) -> list[int]:
    """The cores of one worker: the ``local_rank``-th of ``local_world`` equal consecutive parts of
    ``allowed`` (a remainder goes unused, as ``OMP_NUM_THREADS`` = cores // workers leaves it idle).

    Args:
        allowed: the cores the node's workers may use (this process's affinity).
        local_rank: the worker's index on the node.
        local_world: workers on the node.

    Returns:
        Sorted core ids; all of ``allowed`` when there are fewer cores than workers (no worker can
        have one of its own, so none is bound).

    Raises:
        ValueError: ``local_rank`` is not in ``[0, local_world)``.
    """
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is not one of {local_world} workers")
    cores = sorted(allowed)
    per_worker = len(cores) // local_world
    if per_worker == 0:
        return cores
    return cores[local_rank * per_worker : (local_rank + 1) * per_worker]


def worker_cores(local_rank: int, local_world: int) -> list[int] | None:
    """The cores a CPU worker of this node binds to (``core_share`` of this process's affinity).

    Args:
        local_rank: the worker's index on the node.
        local_world: workers on the node.

    Returns:
        Sorted core ids; None when the worker is not to be bound: a single worker, fewer cores than
        workers, or no affinity call on this OS.
    """
    if local_world <= 1 or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    share = core_share(allowed, local_rank, local_world)
    return None if share == allowed else share


def bind_cpu_worker(env: Mapping[str, str] | None = None) -> list[int] | None:
    """Binds this process to its share of the cores (``worker_cores``) when ``CPU_BIND_ENV`` is "1".

    Call it before torch starts its threads: they inherit the binding, threads already running keep theirs.

    Args:
        env: where ``CPU_BIND_ENV``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are read (default the
            process's environment).

    Returns:
        The cores bound to; None when nothing was bound.
    """
    env = os.environ if env is None else env
    if env.get(CPU_BIND_ENV) != "1":
        return None
    cores = worker_cores(int(env.get("LOCAL_RANK", "0") or 0), int(env.get("LOCAL_WORLD_SIZE", "1") or 1))
    if cores is not None:
        os.sched_setaffinity(0, cores)
    return cores


def binding_preexec(
    local_rank: int, local_world: int, env: Mapping[str, str] | None = None
) -> Callable[[], None] | None:
    """For ``subprocess.Popen(preexec_fn=...)``: binds a CPU worker the probe starts, in the child before
    it runs Python, so every thread it ever starts is on its cores; None when it is not to be bound
    (also when the user set ``CPU_BIND_ENV`` to "0": the probe then measures unbound workers, as that
    user's elixir-run jobs run)."""
    env = os.environ if env is None else env
    if env.get(CPU_BIND_ENV) == "0":
        return None
    cores = worker_cores(local_rank, local_world)
    if cores is None:
        return None
    return functools.partial(os.sched_setaffinity, 0, cores)
