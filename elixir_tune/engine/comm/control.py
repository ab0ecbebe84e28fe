"""A small host-side channel over every rank, apart from the engine's data traffic.

The engine uses it to agree, at the start of each forward and state dict, on what every rank is
about to do (engine/uneven.py). It is a gloo group of CPU tensors whatever the training backend:
reading an nccl result on the host would wait for the device. Its timeout is the run's collective
timeout, so a rank that never arrives ends in a clear error instead of a hang.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class ControlTimeout(RuntimeError):
    """The other ranks did not reach the same control exchange within the timeout."""


class ControlChannel:
    """Tiny integer exchanges over every rank of the world (a gloo group of its own).

    Args:
        world_size: every rank of the run.
        rank: this rank.
        timeout_s: how long an exchange waits for the other ranks.
    """

    def __init__(self, world_size: int, rank: int, timeout_s: float):
        self.world_size = world_size
        self.rank = rank
        self.timeout_s = timeout_s
        # Every rank creates every group, in the same order: this one is created where setup builds
        # the engine, which every rank does.
        self._group = dist.new_group(
            list(range(world_size)), backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length on every rank), in rank order.

        Raises:
            ControlTimeout: some rank did not take part within the timeout.
        """
        mine = torch.tensor(values, dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(rows, mine, group=self._group)
        except RuntimeError as error:
            raise ControlTimeout(str(error).strip().splitlines()[0] if str(error).strip() else "") from error
        return [row.tolist() for row in rows]


# The agreement to settle before the script's own world-wide barrier, teardown or exit: the one used
# last. Every rank runs the same forwards and state dicts, so every rank names the same one. It is held
# strongly (it holds its engine weakly): were it collected on one rank and not on another, as a dropped
# model is, the ranks would wait in different places.
_current: list[Callable[[], None]] = []
_ended: list[bool] = []  # how the script ended, once it did (script_ended)
_originals: dict[str, Callable[..., Any]] = {}


def settle_before_world_waits(settle: Callable[[], None]) -> None:
    """Runs ``settle`` before this process waits for the world, until
    another agreement is used; called at each use of an agreement.

    A DDP script ends with rank 0 saving alone while the others wait in ``dist.barrier()``,
    ``accelerator.wait_for_everyone()`` (the same barrier), ``dist.destroy_process_group()`` or
    simply at the end of the script. Those ranks must serve rank 0's gathers first, as they would in
    their next forward (engine/uneven.py). So torch.distributed's ``barrier`` and
    ``destroy_process_group`` on the default group, and the interpreter's normal exit, first run the
    current ``settle``. The engine's own collectives name their groups and are not affected.
    """
    if not _current or _current[0] != settle:
        _current[:] = [settle]
    if _originals:
        return
    _originals["barrier"], _originals["destroy_process_group"] = dist.barrier, dist.destroy_process_group

    @functools.wraps(_originals["barrier"])
    def barrier(group=None, *args, **kwargs):
        if group is None or group is dist.GroupMember.WORLD:
            _settle_current()
        return _originals["barrier"](group, *args, **kwargs)

    @functools.wraps(_originals["destroy_process_group"])
    def destroy_process_group(group=None):
        if (group is None or group is dist.GroupMember.WORLD) and not _ended:  # the end settled already
            _settle_current()
            _current.clear()  # its channel goes with the world
        return _originals["destroy_process_group"](group)

    dist.barrier, dist.destroy_process_group = barrier, destroy_process_group
    atexit.register(_settle_at_exit)


def _settle_current() -> None:
    if _current:
        _current[0]()


def script_ended(normally: bool) -> None:
    """The end of the script (elixir-run's worker says how it ended; else the interpreter's exit).

    A normal end settles while the world still stands, then ends the process group: a gloo group
    left alive at interpreter exit can abort the process mid-teardown. A failing rank leaves at once
    (the others learn so in their next exchange). Only the first call acts.

    Args:
        normally: the script returned or exited with status 0.
    """
    if _ended or not (dist.is_available() and dist.is_initialized()):
        return
    _ended.append(normally)
    if normally and _current:
        try:
            _settle_current()
        except RuntimeError as error:  # another rank failed: its own error is the one to read
            print(f"elixir-tune: at the end of the script: {error}", file=sys.stderr, flush=True)
            return
        _current.clear()
        # Every rank past its last exchange before any closes its connections, as `barrier();
        # destroy_process_group()` ends a DDP script.
        _originals["barrier"]()
        _originals["destroy_process_group"]()


def _settle_at_exit() -> None:
    # Outside elixir-run's worker nobody said how the script ended: an uncaught exception leaves
    # sys.last_value (a nonzero sys.exit does not, and is taken as normal).
    script_ended(getattr(sys, "last_value", None) is None)
