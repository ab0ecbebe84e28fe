"""One GPU's resources during a simulated micro-batch: the compute stream, the collective stream,
the host->device and device->host links and the CPU (``timeline.simulate_micro_batch`` drives it).

Each lane is the time it is next free. A fetch queues the host->device copy of an offloaded shard,
then the all-gather; a compute step waits for the fetches it needs; a reduction queues the
reduce-scatter, then for an offloaded shard the device->host copy and the host addition. This is the
search's inner loop: the lanes are plain attributes and the maxima are written out (``max()``'s call
costs more; the first of equals is kept, as ``max()`` keeps it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

Record = list[tuple[str, float, float, int]]


class TransferCosts(Protocol):
    """What the lanes read of ``timeline.TransferCosts`` (not imported: timeline imports this module)."""

    allgather_s: float
    reduce_scatter_s: float
    h2d_s: float
    d2h_s: float
    host_add_s: float
    compute_loss: float


class Lanes:
    """The lanes of one micro-batch and what they did.

    Args:
        costs: per-chunk operation times.
        busy_s: how long the collective stream, the host->device and device->host links and the CPU
            are still busy at the start.
        num_steps: compute steps of the micro-batch.
        offloaded: per chunk, whether its shard lives on the host.
        shared_compute: collectives run on the compute resource (the device is the CPU).
        shared_link: collectives hold the inbound and outbound host links too (no NVLink).
        chunk_costs: chunks whose all-gather and reduce-scatter take other times than ``costs``.
        record: when given, every block of work is appended as (lane, start_s, end_s, what).
    """

    __slots__ = (
        "costs",
        "offloaded",
        "shared_compute",
        "shared_link",
        "chunk_costs",
        "record",
        "coll_free",
        "h2d_free",
        "d2h_free",
        "host_free",
        "end",
        "exposed",
        "needed",
        "h2d_count",
        "d2h_count",
        "gathered_s",
        "reduced_s",
        "lost_s",
    )

    def __init__(
        self,
        costs: TransferCosts,
        busy_s: tuple[float, float, float, float],
        num_steps: int,
        offloaded: list[bool],
        shared_compute: bool,
        shared_link: bool,
        chunk_costs: Mapping[int, TransferCosts] | None,
        record: Record | None,
    ):
        self.costs = costs
        self.offloaded = offloaded
        self.shared_compute = shared_compute
        self.shared_link = shared_link
        self.chunk_costs = chunk_costs or None
        self.record = record
        # h2d_free / d2h_free: the inbound / outbound host link of this GPU.
        self.coll_free, self.h2d_free, self.d2h_free, self.host_free = busy_s
        self.end = 0.0  # the compute stream
        self.exposed = 0.0  # time it waited for fetches
        self.needed = [0.0] * num_steps  # per step, when its last fetch is gathered
        self.h2d_count = self.d2h_count = 0
        self.gathered_s = self.reduced_s = 0.0
        self.lost_s = 0.0  # compute time the collectives beside it took (``compute_loss``)

    def run(self, issued_at: list[list[tuple[int, int]]], step_compute_s: list[float], reduce_after: list) -> None:
        """Runs the micro-batch: per step, the fetches issued at its hook, its compute, its reductions."""
        fetch, reduce, needed, record = self.fetch, self.reduce, self.needed, self.record
        end, exposed = self.end, self.exposed
        for step, (issued, compute_s, reduced) in enumerate(zip(issued_at, step_compute_s, reduce_after, strict=False)):
            if issued:
                end, exposed = fetch(issued, end, exposed)
            if needed[step] > end:  # the compute stream waits for the step's fetches
                exposed += needed[step] - end
                end = needed[step]
            end += compute_s
            if record is not None:
                record.append(("compute", end - compute_s, end, step))
            if reduced:
                end = reduce(reduced, end)
        self.end, self.exposed = end, exposed

    def fetch(self, issued: list[tuple[int, int]], end: float, exposed: float) -> tuple[float, float]:
        """Issues the fetches of one step's hook, in order: (step that needs it, chunk) each.

        Args:
            issued: the fetches.
            end: when the compute stream is free.
            exposed: time it waited for fetches so far.

        Returns:
            ``end`` and ``exposed`` after them (a gather on the compute resource stalls it).
        """
        chunk_costs, offloaded, needed, record = self.chunk_costs, self.offloaded, self.needed, self.record
        allgather_s, h2d_s = self.costs.allgather_s, self.costs.h2d_s
        shared_compute, shared_link = self.shared_compute, self.shared_link
        coll_free, h2d_free, d2h_free = self.coll_free, self.h2d_free, self.d2h_free
        gathered_s, h2d_count = self.gathered_s, self.h2d_count
        beside_s = 0.0  # gathers running beside the compute stream
        for fetch_step, chunk in issued:
            gather_s = chunk_costs[chunk].allgather_s if chunk_costs and chunk in chunk_costs else allgather_s
            ready = end
            if offloaded[chunk]:  # its shard crosses the host->device link first
                h2d_free = ready = (h2d_free if h2d_free > ready else ready) + h2d_s
                h2d_count += 1
                if record is not None:
                    record.append(("host-to-device", h2d_free - h2d_s, h2d_free, chunk))
            if shared_compute:  # the gather stalls the compute stream while it runs
                start = end if end > ready else ready
                exposed += start + gather_s - end
                end = coll_free = start + gather_s
            else:
                if ready > coll_free:
                    coll_free = ready
                if shared_link:  # the links are free too
                    coll_free = max_of(coll_free, h2d_free, d2h_free)
                coll_free += gather_s
                beside_s += gather_s
            if record is not None:
                record.append(("all-gather", coll_free - gather_s, coll_free, chunk))
            if shared_link:
                h2d_free = d2h_free = coll_free
            gathered_s += gather_s
            if coll_free > needed[fetch_step]:
                needed[fetch_step] = coll_free
        self.coll_free, self.h2d_free, self.d2h_free = coll_free, h2d_free, d2h_free
        self.gathered_s, self.h2d_count = gathered_s, h2d_count
        return self._lose(beside_s, end), exposed

    def reduce(self, reduced: tuple[int, ...], end: float) -> float:
        """Reduce-scatters the chunks whose gradients are complete; offloaded ones then go to the host.

        Args:
            reduced: the chunks, in order.
            end: when the compute stream is free (they start after it).

        Returns:
            When the compute stream is free after them (later when collectives run on it).
        """
        chunk_costs, record, reduce_scatter_s = self.chunk_costs, self.record, self.costs.reduce_scatter_s
        coll_free, h2d_free, d2h_free = self.coll_free, self.h2d_free, self.d2h_free
        reduced_s = self.reduced_s
        beside_s = 0.0
        for chunk in reduced:
            rs_s = chunk_costs[chunk].reduce_scatter_s if chunk_costs and chunk in chunk_costs else reduce_scatter_s
            if end > coll_free:
                coll_free = end
            if self.shared_link:  # the links are free too; then they carry it
                coll_free = max_of(coll_free, h2d_free, d2h_free) + rs_s
                h2d_free = d2h_free = coll_free
            else:
                coll_free += rs_s
            if record is not None:
                record.append(("reduce-scatter", coll_free - rs_s, coll_free, chunk))
            if self.shared_compute:
                end = coll_free
            else:
                beside_s += rs_s
            reduced_s += rs_s
            if self.offloaded[chunk]:
                d2h_free = self._download(chunk, coll_free, d2h_free)
        self.coll_free, self.h2d_free, self.d2h_free = coll_free, h2d_free, d2h_free
        self.reduced_s = reduced_s
        return self._lose(beside_s, end)

    def _lose(self, beside_s: float, end: float) -> float:
        """When the compute stream is free after collectives of ``beside_s`` seconds ran beside it: their
        kernels slow it by ``compute_loss`` per second (a fetch the compute then waits for absorbs it)."""
        lost_s = beside_s * self.costs.compute_loss
        if lost_s <= 0.0:
            return end
        self.lost_s += lost_s
        return end + lost_s

    def _download(self, chunk: int, reduced_at: float, d2h_free: float) -> float:
        """The reduced shard's device->host copy, then its addition into the host gradient.

        Returns:
            When the device->host link is free again.
        """
        d2h_s, host_add_s = self.costs.d2h_s, self.costs.host_add_s
        d2h_free = (d2h_free if d2h_free > reduced_at else reduced_at) + d2h_s
        host_free = self.host_free
        self.host_free = host_free = (host_free if host_free > d2h_free else d2h_free) + host_add_s
        self.d2h_count += 1
        if self.record is not None:
            self.record.append(("device-to-host", d2h_free - d2h_s, d2h_free, chunk))
            if host_add_s > 0:
                self.record.append(("cpu optimizer", host_free - host_add_s, host_free, chunk))
        return d2h_free


def max_of(first: float, second: float, third: float) -> float:
    """``max(first, second, third)`` keeping the first of equals, without the builtin's call cost."""
    if second > first:
        first = second
    if third > first:
        first = third
    return first
