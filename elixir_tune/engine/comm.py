"""Collectives for the engine: the only module of ``elixir_tune.engine`` that calls torch.distributed.

Thin wrappers over torch.distributed with three extras:
    * a world of one needs no process group: every collective is a local copy;
    * gloo lacks ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in some torch versions
      (2.5, which made DTensor public, to the newest are supported): the wrappers fall back to list
      all-gather and all-reduce;
    * every asynchronous call returns a :class:`Handle` whose ``wait()`` also runs the fallback's
      finishing copy, so callers never see the difference.

The worker's device and the collective timeout, which need no torch.distributed, are in
``engine/worker.py``; DTensor's and tensor parallelism's names are imported on first use.
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist

from elixir_tune.engine.worker import collective_timeout_s, pick_device

if TYPE_CHECKING:  # the lazy names below, for type checkers
    from torch.distributed.device_mesh import DeviceMesh  # noqa: F401
    from torch.distributed.tensor import (  # noqa: F401
        DTensor,
        Partial,
        Replicate,
        Shard,
        distribute_module,
        distribute_tensor,
    )
    from torch.distributed.tensor.experimental import implicit_replication  # noqa: F401
    from torch.distributed.tensor.parallel import (  # noqa: F401
        ColwiseParallel,
        ParallelStyle,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )


# DTensor and tensor-parallel APIs, for engine/parallel/tensor_parallel.py, engine/parallel/tp_adapters.py and
# engine/parallel/tp_grid.py (this module stays the engine's only torch.distributed user). They are imported
# on first use (``__getattr__``): loading torch.distributed.tensor takes about half a second, which
# a plan without tensor parallelism need not pay in every process.
_LAZY_MODULES = {
    "DeviceMesh": "torch.distributed.device_mesh",
    **dict.fromkeys(
        ("DTensor", "Partial", "Replicate", "Shard", "distribute_module", "distribute_tensor"),
        "torch.distributed.tensor",
    ),
    "implicit_replication": "torch.distributed.tensor.experimental",
    **dict.fromkeys(
        (
            "ColwiseParallel",
            "ParallelStyle",
            "PrepareModuleInput",
            "PrepareModuleOutput",
            "RowwiseParallel",
            "SequenceParallel",
            "loss_parallel",
            "parallelize_module",
        ),
        "torch.distributed.tensor.parallel",
    ),
}


def __getattr__(name: str) -> Any:
    """The DTensor and tensor-parallel names (``_LAZY_MODULES``), imported when first asked for."""
    module = _LAZY_MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor, without importing DTensor: no DTensor can exist before
    torch.distributed.tensor is loaded, so a process that never loaded it has none."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


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


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


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


def pipelining():
    """``torch.distributed.pipelining`` (PipelineStage and the schedules), imported on first use: it
    takes about a second and only pipeline plans need it."""
    import torch.distributed.pipelining as torch_pipelining

    return torch_pipelining


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


@dataclass
class Mesh:
    """This rank's place in the world: data x pipeline x tensor.

    Ranks are laid out row-major over (data, pipeline, tensor): ``rank = (data_index * P + stage) *
    T + tensor_index``. Tensor groups are consecutive ranks (their traffic is the heaviest and stays
    within a node); data is outermost.

    Attributes:
        world: every rank.
        data: this rank's data-parallel group; the chunk engine shards over it.
        pipeline: this rank's pipeline group (its rank is the stage).
        tensor: this rank's tensor-parallel group.
        device_mesh: torch's DeviceMesh with dimensions ("data", "pipeline", "tensor") for DTensor
            and pipelining; built only when pipeline or tensor degree is above 1, else None.
    """

    world: Comm
    data: Comm
    pipeline: Comm
    tensor: Comm
    device_mesh: Any = None

    @classmethod
    def data_only(cls, data: Comm) -> Mesh:
        """The mesh of a plan without pipeline or tensor parallelism: the world is the data group."""
        return cls(data, data, _single(data), _single(data))

    @property
    def stage(self) -> int:
        return self.pipeline.rank

    @property
    def tensor_rank(self) -> int:
        return self.tensor.rank

    @property
    def data_rank(self) -> int:
        return self.data.rank


MESH_DIMS = ("data", "pipeline", "tensor")


def _single(world: Comm) -> Comm:
    """A group of one: this rank alone (collectives are local copies)."""
    return Comm(0, 1, "local", world.device, global_ranks=[world.global_ranks[world.rank]])


def _mesh_of(world: Comm, pipeline: int, tensor: int) -> Mesh:
    if pipeline * tensor == 1:
        return Mesh.data_only(world)
    from torch.distributed.device_mesh import init_device_mesh  # only runs with a process group

    data = world.world_size // (pipeline * tensor)
    device_mesh = init_device_mesh(world.device.type, (data, pipeline, tensor), mesh_dim_names=MESH_DIMS)
    comms = []
    for name in MESH_DIMS:
        group = device_mesh.get_group(name)
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) == 1:
            comms.append(_single(world))
        else:
            comms.append(Comm(ranks.index(world.rank), len(ranks), world.backend, world.device, group, ranks))
    return Mesh(world, comms[0], comms[1], comms[2], device_mesh)


def grid_device_mesh(mesh: Mesh, rows: int) -> Any:
    """This rank's tensor group as a ``rows x (T / rows)`` DeviceMesh (Optimus's 2D grid), tensor ranks
    row-major; a collective (every rank of the world calls it).

    Args:
        mesh: the world's mesh.
        rows: grid rows q.

    Returns:
        The 2D DeviceMesh with dimensions ("tensor_row", "tensor_col").
    """
    from torch.distributed.device_mesh import init_device_mesh

    tensor, pipeline = mesh.tensor.world_size, mesh.pipeline.world_size
    data = mesh.world.world_size // (tensor * pipeline)
    full = init_device_mesh(
        mesh.world.device.type,
        (data, pipeline, rows, tensor // rows),
        mesh_dim_names=("data", "pipeline", "tensor_row", "tensor_col"),
    )
    return full["tensor_row", "tensor_col"]


def init_mesh(
    world_size: int,
    device_type: str,
    backend: str,
    pipeline: int = 1,
    tensor: int = 1,
    timeout_s: float | None = None,
) -> Mesh:
    """Joins (or starts) the process group the plan needs and splits it into the plan's mesh.

    Args:
        world_size: every process of the run (data x pipeline x tensor).
        device_type: ``cuda`` or ``cpu``.
        backend: ``nccl`` or ``gloo``.
        pipeline: pipeline degree P.
        tensor: tensor degree T.
        timeout_s: collective timeout; None: ``collective_timeout_s()``.

    Returns:
        This rank's Mesh.

    Raises:
        RuntimeError: the group's size differs from the plan's, or a multi-process plan was not
            started by a launcher.
        ValueError: P x T does not divide the world size.
    """
    if world_size % (pipeline * tensor):
        raise ValueError(
            f"pipeline {pipeline} x tensor {tensor} does not divide the world size {world_size}; "
            "search the plan again or fix its parallel section"
        )
    return _mesh_of(init_comm(world_size, device_type, backend, timeout_s), pipeline, tensor)


def subgroup(world: Comm, rank_lists: list[list[int]]) -> Comm | None:
    """Process groups over given global ranks; this rank's, or None when it is in none.

    A collective over the world: every rank calls it with the same lists, in the same order (torch
    requires every rank to take part in creating every group).

    Args:
        world: the Comm of every rank.
        rank_lists: disjoint lists of global ranks, one per group.
    """
    mine: Comm | None = None
    for ranks in rank_lists:
        group = dist.new_group(ranks) if world.distributed else None
        if world.global_ranks[world.rank] in ranks:
            if len(ranks) == 1:
                mine = _single(world)
            else:
                me = world.global_ranks[world.rank]
                mine = Comm(ranks.index(me), len(ranks), world.backend, world.device, group, list(ranks))
    return mine


def expert_groups(mesh: Mesh, degree: int) -> tuple[Comm, Comm]:
    """The expert-parallel groups inside each data-parallel group (a collective: every rank of the
    world calls it with the same degree).

    Expert group: ``degree`` consecutive data ranks, which hold different experts and exchange tokens.
    Expert-data group: the data ranks ``degree`` apart, which hold the same experts and reduce their
    gradients together. With ``degree`` equal to the data size the expert-data group is one rank.

    Args:
        mesh: this rank's mesh (data groups: the ranks of one stage and tensor index).
        degree: expert degree E (divides the data size).

    Returns:
        (expert group, expert-data group) of this rank.

    Raises:
        ValueError: the degree does not divide the data size.
    """
    size = mesh.data.world_size
    if size % degree:
        raise ValueError(f"expert degree {degree} does not divide the data size {size}; fix parallel.expert.degree")
    if not mesh.world.distributed:
        return _single(mesh.world), _single(mesh.world)
    inner = mesh.world.world_size // size  # ranks per data index: P x T
    data_groups = [[index * inner + place for index in range(size)] for place in range(inner)]
    expert_lists = [group[i : i + degree] for group in data_groups for i in range(0, size, degree)]
    replica_lists = [group[i::degree] for group in data_groups for i in range(degree)]
    expert, replicas = subgroup(mesh.world, expert_lists), subgroup(mesh.world, replica_lists)
    assert expert is not None and replicas is not None, "every rank is in one expert and one expert-data group"
    return expert, replicas


def _all_to_all(comm: Comm, rows: torch.Tensor, send_counts: list[int], receive_counts: list[int]) -> torch.Tensor:
    """Rows ``send_counts[r]`` at a time to each rank r of ``comm``; the rows each rank sent here, in rank order."""
    received = rows.new_empty((sum(receive_counts), *rows.shape[1:]))
    if not comm.distributed:
        received.copy_(rows)
        return received
    dist.all_to_all_single(received, rows.contiguous(), receive_counts, send_counts, group=comm.group)
    return received


class _AllToAll(torch.autograd.Function):
    """Rows sent to the ranks of an expert group; backward sends their gradients back the reverse way."""

    @staticmethod
    def forward(ctx, rows, comm, send_counts, receive_counts):
        ctx.comm, ctx.send_counts, ctx.receive_counts = comm, send_counts, receive_counts
        return _all_to_all(comm, rows, send_counts, receive_counts)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(ctx.comm, grad.contiguous(), ctx.receive_counts, ctx.send_counts), None, None, None


def all_to_all_rows(comm: Comm, rows: torch.Tensor, send_counts: list[int], receive_counts: list[int]) -> torch.Tensor:
    """Sends ``send_counts[r]`` consecutive rows of ``rows`` to rank r of ``comm`` and returns the
    rows received (``receive_counts[r]`` from rank r, in rank order); differentiable: the gradient
    of the received rows goes back to their senders (the reverse all-to-all).

    Args:
        comm: the expert group.
        rows: rows to send, grouped by destination rank.
        send_counts: rows for each rank (sum: ``rows.shape[0]``).
        receive_counts: rows coming from each rank (what each sends here).

    Returns:
        The received rows, ``sum(receive_counts)`` of them.
    """
    return _AllToAll.apply(rows, comm, list(send_counts), list(receive_counts))


def exchange_counts(comm: Comm, counts: torch.Tensor) -> torch.Tensor:
    """Each rank's ``counts[r]`` (int64, one per rank of ``comm``) goes to rank r: returns what every
    rank counted for this one, in rank order."""
    if not comm.distributed:
        return counts.clone()
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=comm.group)
    return received
