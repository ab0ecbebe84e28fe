"""Joining the world's process group, with the collective timeout the launcher sets."""

from __future__ import annotations

import atexit
import datetime
import os

import torch
import torch.distributed as dist

from elixir_tune.engine.comm.collectives import Comm, _destroy_group, pick_device

COLLECTIVE_TIMEOUT_ENV = "ELIXIR_TUNE_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


def collective_timeout_s() -> float:
    """How long a collective may wait for the other ranks before it fails: $ELIXIR_TUNE_COLLECTIVE_TIMEOUT_S
    (elixir-run's --collective-timeout sets it), else 300 s.

    Raises:
        ValueError: the variable is not a positive number.
    """
    text = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"${COLLECTIVE_TIMEOUT_ENV}={text!r}: expected a positive number of seconds")
    return value


def init_comm(world_size: int, device_type: str, backend: str, timeout_s: float | None = None) -> Comm:
    """Joins (or starts) the process group the plan needs.

    Uses an existing default process group, else the torchrun environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT). A plan for one process runs without any process group.

    Args:
        world_size: every process of the run.
        device_type: ``cuda`` or ``cpu``.
        backend: ``nccl`` or ``gloo``.
        timeout_s: how long a collective waits for the other ranks before it raises (gloo's and
            nccl's watchdog); None: ``collective_timeout_s()``.

    Returns:
        The Comm of this rank over the whole world (``init_mesh`` splits it by the plan's degrees).

    Raises:
        RuntimeError: the group's size differs from the plan's, or a multi-process plan was not
            started by a launcher.
    """
    device = pick_device(device_type)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_available():
        if world_size != 1:
            raise RuntimeError(
                f"torch.distributed is not available in this torch build; the plan needs {world_size} processes"
            )
        return Comm(0, 1, "local", device)
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        timeout_s = collective_timeout_s() if timeout_s is None else timeout_s
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        # A gloo group left alive at interpreter exit can abort the process ("terminate called
        # without an active exception"): the group we started, we also end.
        atexit.register(_destroy_group)
    if dist.is_initialized():
        group_size = dist.get_world_size()
        if group_size != world_size:
            raise RuntimeError(
                f"the process group has {group_size} processes but the plan was made for {world_size}; "
                f"launch with `elixir-run plan.yaml train.py` (or torchrun --nproc-per-node {world_size}), "
                "or search a plan for this many processes"
            )
        return Comm(dist.get_rank(), group_size, dist.get_backend(), device)
    if world_size != 1:
        raise RuntimeError(
            f"the plan needs {world_size} processes but this one was started alone (no WORLD_SIZE in the "
            f"environment); launch with `elixir-run plan.yaml train.py` or torchrun --nproc-per-node {world_size}"
        )
    return Comm(0, 1, "local", device)
