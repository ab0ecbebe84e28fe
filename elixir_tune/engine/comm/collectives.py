"""Collectives over one process group: ``Comm`` and the ``Handle`` of an in-flight collective.

Thin wrappers over torch.distributed with three extras:
    * a world of one needs no process group: every collective is a local copy;
    * gloo lacks ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in some torch versions
      (2.5, which made DTensor public, to the newest are supported): the wrappers fall back to list
      all-gather and all-reduce;
    * every asynchronous call returns a :class:`Handle` whose ``wait()`` also runs the fallback's
      finishing copy, so callers never see the difference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class Handle:
    """An in-flight collective: ``wait()`` blocks until its output is ready (idempotent)."""

    def __init__(self, work=None, finish: Callable[[], None] | None = None, keep=()):
        self._work = work
        self._finish = finish
        self._keep = keep  # tensors the collective reads or writes; alive until it completes
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        if self._work is not None:
            self._work.wait()
        if self._finish is not None:
            self._finish()
        self._work = self._finish = None
        self._keep = ()
        self.done = True


DONE = Handle()
DONE.done = True


class Comm:
    """This rank's view of one process group (the world, or one dimension of the mesh).

    Attributes:
        rank: this process's rank in the group.
        world_size: processes in the group.
        backend: ``nccl``, ``gloo`` or ``local`` (a group of one: no process group at all).
        device: the device collectives run on (cuda for nccl, cpu for gloo).
        group: the torch process group (None: the default group).
        global_ranks: the global rank of each member, in group-rank order.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device,
        group=None,
        global_ranks: list[int] | None = None,
    ):
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.group = group
        self.global_ranks = global_ranks if global_ranks is not None else list(range(world_size))
        # gloo's all_gather_into_tensor / reduce_scatter_tensor are slower than list all-gather and
        # all-reduce (2 CPU processes, 16 MB: 11.1 vs 7.7 ms and 19.5 vs 15.5 ms, torch 2.13), and
        # older gloo lacks them: use those paths on gloo. On nccl an error is never answered with
        # another collective: a rank whose native op failed would issue a different sequence of
        # collectives from the others (they would diverge or hang); it raises. None: try the
        # native op first.
        native = {"gloo": False, "nccl": True}.get(backend)
        self._native_gather: bool | None = native
        self._native_scatter: bool | None = native

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_gather_into_tensor(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = True) -> Handle:
        """Gathers every rank's ``shard`` into ``output`` (rank order, contiguous)."""
        if not self.distributed:
            output.copy_(shard)
            return DONE
        if self._native_gather is not False and hasattr(dist, "all_gather_into_tensor"):
            try:
                work = dist.all_gather_into_tensor(output, shard, group=self.group, async_op=async_op)
                self._native_gather = True
                return self._handle(work, None, (output, shard), async_op)
            except (RuntimeError, NotImplementedError, ValueError):
                if self._native_gather:
                    raise
                self._native_gather = False
        parts = list(output.chunk(self.world_size))
        work = dist.all_gather(parts, shard, group=self.group, async_op=async_op)
        return self._handle(work, None, (output, shard, parts), async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = True) -> Handle:
        """Sums ``full`` over ranks and leaves this rank's contiguous part in ``output``."""
        if not self.distributed:
            output.copy_(full)
            return DONE
        if self._native_scatter is not False and hasattr(dist, "reduce_scatter_tensor"):
            try:
                work = dist.reduce_scatter_tensor(output, full, group=self.group, async_op=async_op)
                self._native_scatter = True
                return self._handle(work, None, (output, full), async_op)
            except (RuntimeError, NotImplementedError, ValueError):
                if self._native_scatter:
                    raise
                self._native_scatter = False
        # Fallback (old gloo): all-reduce the whole buffer, keep our part. Twice the traffic, correct.
        work = dist.all_reduce(full, group=self.group, async_op=async_op)
        part = full.chunk(self.world_size)[self.rank]
        return self._handle(work, lambda: output.copy_(part), (output, full), async_op)

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False) -> Handle:
        """Sums ``tensor`` in place over ranks."""
        if not self.distributed:
            return DONE
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return self._handle(work, None, (tensor,), async_op)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Maximum of ``tensor`` in place over ranks (blocking)."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Copies group rank ``src``'s ``tensor`` to every rank of the group (blocking)."""
        if self.distributed:
            dist.broadcast(tensor, src=self.global_ranks[src], group=self.group)

    def gather_to(self, output: torch.Tensor | None, shard: torch.Tensor, dst: int = 0) -> None:
        """Gathers every rank's ``shard`` into ``output`` on group rank ``dst`` only (rank order; blocking).

        Args:
            output: ``world_size * shard.numel()`` elements on rank ``dst``; ignored (may be None) elsewhere.
            shard: this rank's part.
        """
        if self.rank == dst:
            assert output is not None, "gather_to: the destination rank needs an output tensor"
        if not self.distributed:
            assert output is not None  # one rank: it is dst
            output.copy_(shard)
            return
        parts = list(output.chunk(self.world_size)) if output is not None and self.rank == dst else None
        dist.gather(shard, gather_list=parts, dst=self.global_ranks[dst], group=self.group)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (blocking; every rank calls it)."""
        if not self.distributed:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item() > 0)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    @staticmethod
    def _handle(work, finish, keep, async_op: bool) -> Handle:
        handle = Handle(work if async_op else None, finish, keep)
        if not async_op:
            handle.wait()
        return handle


def gather_objects(comm: Comm, obj: Any, all_ranks: bool = False) -> list[Any] | None:
    """Every rank's picklable ``obj`` in group-rank order: on group rank 0 (None elsewhere), or on every rank."""
    if not comm.distributed:
        return [obj]
    objects: list[Any] = [None] * comm.world_size
    if all_ranks:
        dist.all_gather_object(objects, obj, group=comm.group)
        return objects
    dist.gather_object(obj, objects if comm.rank == 0 else None, dst=comm.global_ranks[0], group=comm.group)
    return objects if comm.rank == 0 else None


def shared_errors(comm: Comm, error: str | None) -> list[str]:
    """Every rank's error, on every rank (a collective: every rank of ``comm`` calls it, failed or not).

    The status exchange that keeps a failure on one rank from hanging the others: a rank that
    raised alone would leave its peers waiting in their next collective until the collective
    timeout. Each rank passes what went wrong on it (None: nothing), and all of them get the
    same list back, so that all raise the same error, or none does.

    Args:
        comm: the group whose ranks must agree.
        error: this rank's one-line error, or None.

    Returns:
        The distinct errors in group-rank order (empty when every rank succeeded).
    """
    errors = gather_objects(comm, error, all_ranks=True) or [error]
    return list(dict.fromkeys(text for text in errors if text))
