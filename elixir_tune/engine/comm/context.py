"""Context parallelism's groups and exchanges: the context groups of a data x context world,
Ulysses's differentiable all-to-alls (sequence shards of all heads <-> whole sequence of some heads),
the all-gather form's differentiable gather and ring attention's asynchronous pass to the next rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from elixir_tune.engine.comm.collectives import Comm, Handle
from elixir_tune.engine.comm.experts import all_to_all_rows
from elixir_tune.engine.comm.mesh import single_comm, subgroup


def context_group(world: Comm, degree: int, tensor: int = 1) -> Comm:
    """This rank's context group: the ``degree`` ranks at one data index, stage and tensor index
    (``rank = ((data_index * P + stage) * C + context_index) * T + tensor_index``: T apart). A
    collective: every rank calls it.

    Args:
        world: the Comm of every rank.
        degree: context degree C (C x T divides the world size).
        tensor: tensor degree T.

    Raises:
        ValueError: C x T does not divide the world size.
    """
    if world.world_size % (degree * tensor):
        raise ValueError(
            f"context degree {degree} x tensor degree {tensor} does not divide the world size {world.world_size}"
        )
    if degree == 1 or not world.distributed:
        return single_comm(world)
    block = degree * tensor  # the ranks of one (data index, stage): C context x T tensor indices
    lists = [
        [start + index * tensor + offset for index in range(degree)]
        for start in range(0, world.world_size, block)
        for offset in range(tensor)
    ]
    group = subgroup(world, lists)
    assert group is not None, "every rank is in one context group"
    return group


def sequence_to_heads(comm: Comm, states: torch.Tensor) -> torch.Tensor:
    """Ulysses's first exchange: this rank's sequence shard of every head in, the whole sequence of
    its 1/C of the heads out (differentiable).

    Args:
        comm: the context group (C ranks, in sequence-shard order).
        states: (batch, heads, local_len, head_dim), heads divisible by C.

    Returns:
        (batch, heads / C, C x local_len, head_dim): head group ``comm.rank``, shards in rank order.
    """
    size = comm.world_size
    batch, heads, length, dim = states.shape
    # Row j of the send buffer is head group j: it goes to rank j.
    rows = states.reshape(batch, size, heads // size, length, dim).transpose(0, 1).contiguous()
    received = all_to_all_rows(comm, rows.reshape(size * batch, -1), [batch] * size, [batch] * size)
    # Row i came from rank i: its sequence shard of this rank's heads.
    received = received.reshape(size, batch, heads // size, length, dim)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * length, dim)


def heads_to_sequence(comm: Comm, output: torch.Tensor) -> torch.Tensor:
    """Ulysses's second exchange, the inverse of ``sequence_to_heads`` for attention's output layout
    (differentiable).

    Args:
        comm: the context group.
        output: (batch, C x local_len, heads / C, head_dim): this rank's heads over the whole sequence.

    Returns:
        (batch, local_len, heads, head_dim): every head over this rank's sequence shard.
    """
    size = comm.world_size
    batch, length, local_heads, dim = output.shape
    local_len = length // size
    # Row j is sequence shard j: it goes to rank j.
    rows = output.reshape(batch, size, local_len, local_heads, dim).transpose(0, 1).contiguous()
    received = all_to_all_rows(comm, rows.reshape(size * batch, -1), [batch] * size, [batch] * size)
    # Row i came from rank i: head group i over this rank's shard.
    received = received.reshape(size, batch, local_len, local_heads, dim)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, local_len, size * local_heads, dim)


def sum_over(comm: Comm, value: torch.Tensor) -> torch.Tensor:
    """The sum of a detached tensor over ``comm`` (a new tensor; not differentiable)."""
    total = value.detach().clone()
    comm.all_reduce_sum(total)
    return total


class _GatherSequence(torch.autograd.Function):
    """Every rank's shard concatenated in rank order; backward sums each shard's gradient over the
    ranks (every rank's queries read every key) and returns this rank's part."""

    @staticmethod
    def forward(ctx, shard, comm):
        ctx.comm = comm
        # Flat buffers: gloo's list fallback of Comm's gathers splits the output along its first dimension.
        gathered = shard.new_empty(comm.world_size * shard.numel())
        comm.all_gather_into_tensor(gathered, shard.reshape(-1), async_op=False).wait()
        return gathered.view(comm.world_size, *shard.shape)

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        part = grad.new_empty(grad[0].shape)
        # A copy: the gloo fallback reduces its input in place, and autograd may still hold the gradient.
        comm.reduce_scatter_tensor(part.view(-1), grad.reshape(-1).clone(), async_op=False).wait()
        return part, None


def gather_sequence(comm: Comm, states: torch.Tensor) -> torch.Tensor:
    """The all-gather exchange (Llama 3's context parallelism): every rank's keys or values, whole
    (differentiable: the gradient is reduce-scattered back to the shards' owners).

    Args:
        comm: the context group.
        states: (batch, heads, local_len, head_dim), this rank's tokens.

    Returns:
        (batch, heads, C x local_len, head_dim): the ranks' tokens in rank order (each rank's in its
        own order; the caller knows which positions they are).
    """
    gathered = _GatherSequence.apply(states, comm)  # (C, batch, heads, local_len, head_dim)
    size, batch, heads, length, dim = gathered.shape
    return gathered.permute(1, 2, 0, 3, 4).reshape(batch, heads, size * length, dim)


def ring_pass(comm: Comm, send: torch.Tensor, tag: int = 0) -> tuple[torch.Tensor, Handle]:
    """Starts sending ``send`` to the next rank of the ring and receiving the previous rank's tensor
    of the same shape (ring attention's step; not differentiable: its autograd function passes the
    gradients itself).

    Args:
        comm: the context group; rank r sends to r + 1 and receives from r - 1 (mod C).
        send: a contiguous tensor on ``comm.device``; it must not change until the handle is waited.
        tag: tells concurrent passes between the same ranks apart (keys and values vs. their gradients).

    Returns:
        The receive buffer (valid after ``wait()``) and the handle of both transfers.
    """
    received = torch.empty_like(send)
    if not comm.distributed:
        received.copy_(send)
        return received, Handle(finish=lambda: None)
    size = comm.world_size
    following, preceding = comm.global_ranks[(comm.rank + 1) % size], comm.global_ranks[(comm.rank - 1) % size]
    # Receive posted before the send: with two ranks each is the other's neighbour on both sides.
    works = [
        dist.irecv(received, src=preceding, group=comm.group, tag=tag),
        dist.isend(send, dst=following, group=comm.group, tag=tag),
    ]

    def finish() -> None:
        for work in works:
            if work is not None:  # None only for a rank outside the group, which never calls this
                work.wait()

    return received, Handle(finish=finish, keep=(send, received))
