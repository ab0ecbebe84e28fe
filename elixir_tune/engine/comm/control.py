"""A small host-side channel over every rank, apart from the engine's data traffic.

The engine uses it to agree, at the start of each forward and state dict, on what every rank is
about to do (engine/uneven.py). It is a gloo group of CPU tensors whatever the training backend:
reading an nccl result on the host would wait for the device. Its timeout is the run's collective
timeout, so a rank that never arrives ends in a clear error instead of a hang.
"""

from __future__ import annotations

import datetime

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
