"""The process group and the mesh: joining the world, splitting it into data x pipeline x tensor
groups (``Mesh``), the 2D tensor grid, and groups over given ranks (``subgroup``)."""

from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from elixir_tune.device import ops_for
from elixir_tune.engine.comm.collectives import Comm
from elixir_tune.engine.worker import collective_timeout_s, pick_device


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def init_group_of_one(backend: str) -> None:
    """A process group of this process alone, for the peer engines (FSDP2's device mesh, DeepSpeed),
    which need one even for a plan of one process; the chunk engine runs such plans without any."""
    if dist.is_available() and not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        atexit.register(_destroy_group)


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
    ops_for(device).set_device()
    if not dist.is_available():
        if world_size != 1:
            raise RuntimeError(
                f"torch.distributed is not available in this torch build; the plan needs {world_size} processes"
            )
        return Comm(0, 1, "local", device)
    timeout_s = collective_timeout_s() if timeout_s is None else timeout_s
    started_by_script = dist.is_available() and dist.is_initialized()
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
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
        if started_by_script and group_size > 1:
            # The script started the group with a timeout of its own (torch's default is 10 to 30
            # minutes): the engine's collectives run on a group of the same ranks with ours.
            ranks = list(range(group_size))
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
            return Comm(dist.get_rank(), group_size, dist.get_backend(), device, group, ranks)
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
        return cls(data, data, single_comm(data), single_comm(data))

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


def single_comm(world: Comm) -> Comm:
    """A group of one: this rank alone (collectives are local copies)."""
    return Comm(0, 1, "local", world.device, global_ranks=[world.global_ranks[world.rank]])


def _mesh_of(world: Comm, pipeline: int, tensor: int, context: int = 1) -> Mesh:
    if pipeline * tensor == 1:
        return Mesh.data_only(world)
    if pipeline > 1 and context > 1:
        return _context_pipeline_mesh(world, pipeline, tensor, context)
    from torch.distributed.device_mesh import init_device_mesh  # only runs with a process group

    data = world.world_size // (pipeline * tensor)
    device_mesh = init_device_mesh(world.device.type, (data, pipeline, tensor), mesh_dim_names=MESH_DIMS)
    comms = []
    for name in MESH_DIMS:
        group = device_mesh.get_group(name)
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) == 1:
            comms.append(single_comm(world))
        else:
            comms.append(Comm(ranks.index(world.rank), len(ranks), world.backend, world.device, group, ranks))
    return Mesh(world, comms[0], comms[1], comms[2], device_mesh)


def _context_pipeline_mesh(world: Comm, pipeline: int, tensor: int, context: int) -> Mesh:
    """The mesh of a pipeline beside context parallelism: ``rank = ((data_index * P + stage) * C +
    context_index) * T + tensor_index``. The chunk engine's group (``Mesh.data``) is data x context: the
    ranks at this rank's stage and tensor index, which hold the same weights."""
    from torch.distributed.device_mesh import init_device_mesh  # only runs with a process group

    data = world.world_size // (pipeline * context * tensor)
    names = ("data", "pipeline", "context", "tensor")
    device_mesh = init_device_mesh(world.device.type, (data, pipeline, context, tensor), mesh_dim_names=names)
    comms = {}
    for name in ("pipeline", "tensor"):
        ranks = dist.get_process_group_ranks(device_mesh.get_group(name))
        comms[name] = (
            single_comm(world)
            if len(ranks) == 1
            else Comm(
                ranks.index(world.rank), len(ranks), world.backend, world.device, device_mesh.get_group(name), ranks
            )
        )
    lists = [
        [((d * pipeline + stage) * context + c) * tensor + t for d in range(data) for c in range(context)]
        for stage in range(pipeline)
        for t in range(tensor)
    ]
    shards = subgroup(world, lists)
    assert shards is not None, "every rank is in one data x context group"
    return Mesh(world, shards, comms["pipeline"], comms["tensor"], device_mesh)


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
    context: int = 1,
) -> Mesh:
    """Joins (or starts) the process group the plan needs and splits it into the plan's mesh.

    Args:
        world_size: every process of the run (data x pipeline x tensor).
        device_type: ``cuda`` or ``cpu``.
        backend: ``nccl`` or ``gloo``.
        pipeline: pipeline degree P.
        tensor: tensor degree T.
        timeout_s: collective timeout; None: ``collective_timeout_s()``.
        context: context degree C; beside a pipeline it sits between the stage and the tensor index
            (its groups are made by ``comm/context.py``; without a pipeline it is part of the data index).

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
    return _mesh_of(init_comm(world_size, device_type, backend, timeout_s), pipeline, tensor, context)


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
                mine = single_comm(world)
            else:
                me = world.global_ranks[world.rank]
                mine = Comm(ranks.index(me), len(ranks), world.backend, world.device, group, list(ranks))
    return mine
