"""Expert parallelism's groups and token exchange: the expert and expert-data groups of a mesh, and
the differentiable all-to-all that sends a mixture's tokens to the ranks holding their experts."""

from __future__ import annotations

import torch
import torch.distributed as dist

from elixir_tune.engine.comm.collectives import Comm
from elixir_tune.engine.comm.mesh import Mesh, single_comm, subgroup


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
        return single_comm(mesh.world), single_comm(mesh.world)
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
