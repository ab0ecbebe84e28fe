"""Step time: a timeline of one optimizer step over resources that run in parallel.

Resources: the compute stream, the collective stream (all-gathers and reduce-scatters in program
order), the host->device and device->host copy engines, and the CPU optimizer. Per micro-batch:

* before step j runs, every chunk it needs must be gathered: an offloaded shard is first copied
  host->device, then the chunk is all-gathered (compute dtype) into a cache block;
* a fetch is issued at the hook of its own step, or up to ``prefetch`` fetches earlier, but never
  before the block it evicts is free (the evicted chunk's last use has run);
* after a chunk's last use its gradients are complete: reduce-scatter into the shard, then, when
  the shard is offloaded, a device->host copy of the reduced shard in the compute dtype on its own
  copy engine, and its accumulation into the fp32 host gradient on the CPU as it arrives. Both
  overlap the rest of backward (the engine after issue 10: own stream, pinned buffers, one event
  per chunk); only what is left when the compute ends is exposed.
* uploads of offloaded shards move the compute dtype (a compute-dtype host copy kept next to the
  fp32 master), not fp32.

On PCIe-only machines (``shared_host_link``: no NVLink) the collectives cross the same PCIe link
as the host<->device copies: each GPU has one inbound and one outbound link, an upload holds the
inbound one, a copy-down the outbound one, and a collective (a ring sends and receives) both.

On a CPU device the collectives run on the same cores as the compute (gloo copies, reduces and
talks TCP on them), so they do not overlap: ``shared_compute`` puts them on the compute stream.
Measured on 2 cores (benchmarks/results/prediction-cpu.md), the overlapped model predicted steps
1.25-1.91x too fast; the serial sum came within 1.00-1.30x.

The first micro-batch starts from a cold cache, the later ones from the steady state. Micro-batch
k starts when the compute of micro-batch k-1 ends, and what k-1 left on the links (reduce-scatters,
device->host copies, host additions still queued) keeps them busy into k: every resource carries
over (``MicroBatchTime.leftover_s``), so no resource is ever busy longer than the step. Steady
micro-batches are simulated one after the other until one starts with the same leftover as the one
before it; from there each repeats exactly (the timeline only shifts), so the rest are copies of it.
When a resource is the bottleneck its backlog grows by the same amount every micro-batch instead
(``_drifted``): once two steady ones differ only by that growth, the rest are the last one with the
backlog grown again, and the last of the step is simulated to check it (a search over 175B-model
steps of hundreds of micro-batches otherwise simulates every one).
After the last micro-batch: the gradient-norm all-reduce, then Adam on the device shards (GPU) and
on the host shards (CPU) in parallel; the step ends with the slower.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elixir_tune.costmodel.lanes import Lanes
from elixir_tune.costmodel.links import inter_node_bytes_per_s
from elixir_tune.hardware.spec import HardwareSpec
from elixir_tune.plan.schema import DTYPE_BYTES

# Fused AdamW reads param, grad, m, v and writes param, m, v: 28 bytes per fp32 element.
ADAM_BYTES_PER_ELEMENT = 28


@dataclass
class TransferCosts:
    """Seconds of each per-chunk operation for one chunk size on one cluster.

    Attributes:
        h2d_s: host->device copy of one shard (compute dtype).
        allgather_s: gathering one chunk (cast included; a cast only with one rank).
        reduce_scatter_s: reducing one chunk's gradients into the fp32 shard.
        d2h_s: device->host copy of one shard's gradients (compute dtype).
        grad_norm_s: the all-reduce of the global gradient norm.
        host_add_s: adding one arrived gradient shard into its fp32 host gradient (CPU).
        compute_loss: seconds of compute lost per second of all-gather or reduce-scatter beside it
            (``HardwareSpec.collective_compute_loss``; 0 with one rank).
    """

    h2d_s: float
    allgather_s: float
    reduce_scatter_s: float
    d2h_s: float
    grad_norm_s: float
    host_add_s: float = 0.0
    compute_loss: float = 0.0


def transfer_costs(
    hardware: HardwareSpec,
    chunk_size: int,
    world_size: int,
    gpus_per_node: int,
    nodes: int,
    dtype: str,
    group_ranks_per_node: int | None = None,
) -> TransferCosts:
    """Per-chunk operation times from the hardware's measured bandwidths and latencies.

    Args:
        hardware: the node spec.
        chunk_size: elements per chunk.
        world_size: data-parallel size.
        gpus_per_node: ranks per node (they share the host links).
        nodes: number of nodes (collectives across nodes use the inter-node bandwidth).
        dtype: compute dtype.
        group_ranks_per_node: the data group's ranks on one node (default: every rank of the
            node); across nodes the group gets that share of the node's bandwidth
            (``costmodel/links.py``).

    Returns:
        The costs.
    """
    dtype_bytes = DTYPE_BYTES[dtype]
    shard_numel = chunk_size // world_size
    hbm_bps = hardware.hbm_gbps * 1e9
    h2d_bps = (hardware.h2d_gbps_all if gpus_per_node > 1 else hardware.h2d_gbps) * 1e9
    d2h_bps = (hardware.d2h_gbps_all if gpus_per_node > 1 else hardware.d2h_gbps) * 1e9
    # Casting the fp32 master shard to the compute dtype, and adding gradients into the fp32 shard.
    cast_s = shard_numel * (4 + dtype_bytes) / hbm_bps
    accumulate_s = shard_numel * (8 + dtype_bytes) / hbm_bps
    gather_s, reduce_s, norm_s = cast_s, accumulate_s, 0.0
    if world_size > 1:
        wire_bytes = chunk_size * dtype_bytes * (world_size - 1) / world_size
        group = gpus_per_node if group_ranks_per_node is None else group_ranks_per_node
        inter_bps = inter_node_bytes_per_s(hardware, gpus_per_node, group)
        ag_bps = inter_bps if nodes > 1 else hardware.allgather_gbps * 1e9
        rs_bps = inter_bps if nodes > 1 else hardware.reduce_scatter_gbps * 1e9
        gather_s += hardware.collective_latency_s + wire_bytes / ag_bps
        reduce_s += hardware.collective_latency_s + wire_bytes / rs_bps
        norm_s = hardware.collective_latency_s
    # Host accumulation reads the fp32 gradient and the arrived compute-dtype shard and writes fp32
    # (8 + dtype bytes per element) where Adam moves 28: memory-bound like Adam, so its rate is
    # Adam's scaled by the bytes. On a CPU device host and device are one memory and the
    # reduce-scatter above already accumulated.
    host_add_s = 0.0
    if hardware.device != "cpu":
        host_add_bps = hardware.cpu_adam_rate_per_rank(gpus_per_node) * ADAM_BYTES_PER_ELEMENT
        host_add_s = shard_numel * (8 + dtype_bytes) / host_add_bps
    h2d_s = hardware.copy_latency_s + shard_numel * dtype_bytes / h2d_bps
    d2h_s = hardware.copy_latency_s + shard_numel * dtype_bytes / d2h_bps
    if hardware.device == "cpu":
        # One memory: the reduced shard is added from the staging buffer (no copy down), and in fp32
        # the upload copy is the master itself, written into the payload as a device shard's cast is
        # (``gather_s`` prices that); in bf16/fp16 the compute-dtype host copy is read instead of
        # casting the master, about the same bytes.
        d2h_s = 0.0
        if dtype_bytes == 4:
            h2d_s = 0.0
    return TransferCosts(
        h2d_s=h2d_s,
        allgather_s=gather_s,
        reduce_scatter_s=reduce_s,
        d2h_s=d2h_s,
        grad_norm_s=norm_s,
        host_add_s=host_add_s,
        compute_loss=hardware.collective_compute_loss if world_size > 1 else 0.0,
    )


def issue_steps(fetches: list[tuple[int, int, int]], prefetch: int) -> list[int]:
    """The step at whose hook each fetch is issued.

    Args:
        fetches: (step, chunk, free_after_step) in order.
        prefetch: how many fetches ahead the engine may run.

    Returns:
        Per fetch, the issue step (never after its own step, never before its block is free).
    """
    out = []
    for index, (step, _chunk, free_after) in enumerate(fetches):
        # min(step, max(earliest, free_after + 1)) without the builtins' call cost (the search's inner loop)
        earliest = fetches[index - prefetch][0] if index >= prefetch else 0
        issue = free_after + 1 if free_after + 1 > earliest else earliest
        out.append(issue if issue < step else step)
    return out


def issue_groups(fetches: list[tuple[int, int, int]], issue: list[int], num_steps: int) -> list[list[tuple[int, int]]]:
    """Per step, the fetches issued at its hook as (step that needs it, chunk), in fetch order.

    Args:
        fetches: (step, chunk, free_after_step) in order.
        issue: issue step of each fetch (``issue_steps``).
        num_steps: steps of the micro-batch.
    """
    issued_at: list[list[tuple[int, int]]] = [[] for _ in range(num_steps)]
    for (fetch_step, chunk, _free), step in zip(fetches, issue, strict=True):
        issued_at[step].append((fetch_step, chunk))
    return issued_at


@dataclass
class MicroBatchTime:
    """One simulated micro-batch.

    Times count from the micro-batch's start (the end of the previous one's compute).

    Attributes:
        compute_end_s: when its last compute step ends.
        drained_s: when its last reduce-scatter / device->host copy / host addition ends.
        exposed_fetch_s: time the compute stream waited for fetches.
        allgather_s, reduce_scatter_s, h2d_s, d2h_s: busy time of each resource.
        leftover_s: how long after ``compute_end_s`` the collective stream, the host->device and
            device->host links and the CPU stay busy (``LEFTOVER_ZERO`` when all are free): the
            next micro-batch starts with them busy.
        compute_loss_s: compute time the collectives beside it took (``TransferCosts.compute_loss``).
    """

    compute_end_s: float
    drained_s: float
    exposed_fetch_s: float
    allgather_s: float
    reduce_scatter_s: float
    h2d_s: float
    d2h_s: float
    leftover_s: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    compute_loss_s: float = 0.0


# Nothing left busy: (collective stream, host->device link, device->host link, CPU).
LEFTOVER_ZERO = (0.0, 0.0, 0.0, 0.0)


def simulate_micro_batch(
    step_compute_s: list[float],
    fetches: list[tuple[int, int, int]],
    issue: list[int],
    reduce_after: list[tuple[int, ...]],
    offloaded: list[bool],
    costs: TransferCosts,
    shared_compute: bool = False,
    shared_link: bool = False,
    record: list[tuple[str, float, float, int]] | None = None,
    busy_s: tuple[float, float, float, float] = LEFTOVER_ZERO,
    chunk_costs: dict[int, TransferCosts] | None = None,
    issued_at: list[list[tuple[int, int]]] | None = None,
) -> MicroBatchTime:
    """Runs one micro-batch's timeline.

    Args:
        step_compute_s: compute seconds of each step.
        fetches: (step, chunk, free_after_step) in order.
        issue: issue step of each fetch (``issue_steps``).
        reduce_after: per step, the chunks whose gradients are complete after it.
        offloaded: per chunk, whether its shard lives on the host.
        costs: per-chunk operation times.
        shared_compute: collectives run on the compute resource (the device is the CPU).
        shared_link: collectives hold the inbound and outbound host links too (no NVLink).
        record: when given, every block of work is appended to it as (lane, start_s, end_s, what):
            ``what`` is the step index on the compute lane, the chunk id on the others (lanes of
            ``costmodel.picture.LANES``).
        busy_s: how long the collective stream, the host->device and device->host links and the
            CPU are still busy when it starts (the previous micro-batch's ``leftover_s``).
        chunk_costs: chunks whose all-gather and reduce-scatter take other times than ``costs``
            (expert chunks, sharded over another group), with theirs.
        issued_at: ``issue_groups(fetches, issue, len(step_compute_s))`` when the caller keeps it (the
            search simulates each fetch list many times).

    Returns:
        The micro-batch's times.
    """
    num_steps = len(step_compute_s)
    if issued_at is None:
        issued_at = issue_groups(fetches, issue, num_steps)
    lanes = Lanes(costs, busy_s, num_steps, offloaded, shared_compute, shared_link, chunk_costs, record)
    lanes.run(issued_at, step_compute_s, reduce_after)
    end = lanes.end
    return MicroBatchTime(
        compute_end_s=end,
        drained_s=max(end, lanes.coll_free, lanes.h2d_free, lanes.d2h_free, lanes.host_free),
        exposed_fetch_s=lanes.exposed,
        allgather_s=lanes.gathered_s,
        reduce_scatter_s=lanes.reduced_s,
        h2d_s=lanes.h2d_count * costs.h2d_s,
        d2h_s=lanes.d2h_count * costs.d2h_s,
        leftover_s=(
            max(0.0, lanes.coll_free - end),
            max(0.0, lanes.h2d_free - end),
            max(0.0, lanes.d2h_free - end),
            max(0.0, lanes.host_free - end),
        ),
        compute_loss_s=lanes.lost_s,
    )


def micro_batches(
    cold: MicroBatchTime,
    passes: int,
    simulate_steady: Callable[[tuple[float, float, float, float]], MicroBatchTime],
) -> list[MicroBatchTime]:
    """Every micro-batch (pass) of a step, each started with what the one before left busy.

    Args:
        cold: the first, simulated from a cold cache and free resources.
        passes: micro-batches (passes) of the step.
        simulate_steady: simulates a steady micro-batch that starts with the given ``busy_s``.

    Returns:
        ``passes`` micro-batches in order: once a steady one starts with the same leftover as the
        one before it, the rest are the same object repeated (their timelines are shifts of it).
    """
    parts = [cold]
    started_with: tuple[float, float, float, float] | None = None
    while len(parts) < passes:
        busy = parts[-1].leftover_s
        if len(parts) > 1 and started_with is not None and _close(busy, started_with):
            parts += [parts[-1]] * (passes - len(parts))
            break
        if len(parts) > 2 and passes - len(parts) > 1:
            rest = _drifted(parts[-3:], passes - len(parts), simulate_steady)
            if rest is not None:
                parts += rest
                break
        started_with = busy
        parts.append(simulate_steady(busy))
    return parts


def _close(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Equal to the last few digits (the timelines add the same costs in another order)."""
    return all(abs(x - y) <= 1e-12 * (1.0 + abs(y)) for x, y in zip(a, b, strict=True))


def _drifted(
    last_three: list[MicroBatchTime],
    remaining: int,
    simulate_steady: Callable[[tuple[float, float, float, float]], MicroBatchTime],
) -> list[MicroBatchTime] | None:
    """The ``remaining`` micro-batches after a backlog that grows by a constant, or None.

    The last two micro-batches must be the same but for what they leave busy (``leftover_s``, and
    ``drained_s`` with it), which grew by the same amount twice. The ones returned before the last
    are the last simulated one repeated, whose backlog is not the grown one: callers read the
    backlog of the step's final micro-batch only. A timeline is built of sums and
    maxima, so a micro-batch's figures only grow with the backlog it starts with: the ones between
    equal the last simulated one as long as the step's final micro-batch, whose backlog is the
    largest, still equals it. That one is simulated from its extrapolated backlog and must match the
    extrapolation, or None is returned (the caller then simulates each).
    """
    first, second, third = last_three
    delta = tuple(b - a for a, b in zip(first.leftover_s, second.leftover_s, strict=True))
    grew = tuple(b - a for a, b in zip(second.leftover_s, third.leftover_s, strict=True))
    if not any(d > 0 for d in delta) or any(d < 0 for d in delta) or not _close(grew, delta):
        return None
    if not _same_but_backlog(second, third):
        return None

    def shifted(count: int) -> MicroBatchTime:
        leftover = tuple(x + count * d for x, d in zip(third.leftover_s, delta, strict=True))
        drained = third.compute_end_s + max(0.0, *leftover)
        return MicroBatchTime(
            third.compute_end_s,
            drained,
            third.exposed_fetch_s,
            third.allgather_s,
            third.reduce_scatter_s,
            third.h2d_s,
            third.d2h_s,
            (leftover[0], leftover[1], leftover[2], leftover[3]),
            third.compute_loss_s,
        )

    final = simulate_steady(shifted(remaining - 1).leftover_s)
    expected = shifted(remaining)
    if not (_same_but_backlog(final, third) and _close(final.leftover_s, expected.leftover_s)):
        return None
    # The ones between are the last simulated one repeated: only the step's final micro-batch's
    # backlog is read (``combine_step``, ``step_blocks``), and their other figures are its figures.
    return [third] * (remaining - 1) + [final]


def _same_but_backlog(a: MicroBatchTime, b: MicroBatchTime) -> bool:
    """Two micro-batches that differ at most in what they leave busy."""
    return _close(
        (a.compute_end_s, a.exposed_fetch_s, a.allgather_s, a.reduce_scatter_s, a.h2d_s, a.d2h_s),
        (b.compute_end_s, b.exposed_fetch_s, b.allgather_s, b.reduce_scatter_s, b.h2d_s, b.d2h_s),
    ) and _close((a.drained_s - max(0.0, *a.leftover_s),), (b.drained_s - max(0.0, *b.leftover_s),))


def combine_step(
    parts: list[MicroBatchTime],
    costs: TransferCosts,
    gpu_adam_s: float,
    cpu_adam_s: float,
    compute_s: float,
    recompute_s: float,
    serial_optimizers: bool = False,
) -> tuple[float, dict[str, float]]:
    """Step time from its micro-batches, plus the optimizer.

    Args:
        parts: every micro-batch (pass) of the step in order (``micro_batches``).
        costs: per-chunk operation times.
        gpu_adam_s: Adam over the device shards.
        cpu_adam_s: Adam over the host shards.
        compute_s: compute of the whole step (recompute included).
        recompute_s: the recompute part of it.
        serial_optimizers: the device is the CPU itself, so the two Adam steps share its cores.

    Returns:
        (step_time_s, breakdown).
    """
    backward_done = sum(p.compute_end_s for p in parts[:-1]) + parts[-1].drained_s
    optimizer_s = gpu_adam_s + cpu_adam_s if serial_optimizers else max(gpu_adam_s, cpu_adam_s)
    step_time = backward_done + costs.grad_norm_s + optimizer_s
    breakdown = {
        "compute_s": compute_s,
        "recompute_s": recompute_s,
        "exposed_fetch_s": sum(p.exposed_fetch_s for p in parts),
        "grad_drain_s": parts[-1].drained_s - parts[-1].compute_end_s,
        "allgather_s": sum(p.allgather_s for p in parts),
        "reduce_scatter_s": sum(p.reduce_scatter_s for p in parts),
        "h2d_s": sum(p.h2d_s for p in parts),
        "d2h_s": sum(p.d2h_s for p in parts),
        "optimizer_gpu_s": gpu_adam_s,
        "optimizer_cpu_s": cpu_adam_s,
        "optimizer_exposed_s": costs.grad_norm_s + optimizer_s,
        "collective_compute_loss_s": sum(p.compute_loss_s for p in parts),
    }
    return step_time, breakdown


def step_blocks(
    parts: list[MicroBatchTime],
    records: list[list[tuple[str, float, float, int]]],
    costs: TransferCosts,
    gpu_adam_s: float,
    cpu_adam_s: float,
    serial_optimizers: bool = False,
) -> list[tuple[str, float, float, str, int]]:
    """Every block of work of the step, placed as ``combine_step`` places the micro-batches.

    Micro-batch k starts when the compute of micro-batch k-1 ends (what k-1 left busy runs on into
    it); after the last one drains come the gradient-norm all-reduce and the two optimizers.

    Args:
        parts: every micro-batch of the step (``micro_batches``).
        records: what ``simulate_micro_batch`` recorded of each distinct simulated one, in order
            (a repeated last one reuses the last record).
        costs, gpu_adam_s, cpu_adam_s, serial_optimizers: as for ``combine_step``.

    Returns:
        (lane, start_s, end_s, what, index) per block: what is "step" (index: the step), "chunk"
        (index: the chunk id), "norm" or "adam" (index: the micro-batch count).
    """
    out: list[tuple[str, float, float, str, int]] = []
    offset_s = backward_done_s = 0.0
    for micro, part in enumerate(parts):
        blocks = records[min(micro, len(records) - 1)]
        for lane, start_s, end_s, index in blocks:
            out.append((lane, offset_s + start_s, offset_s + end_s, "step" if lane == "compute" else "chunk", index))
        backward_done_s = offset_s + part.drained_s
        offset_s += part.compute_end_s
    grad_accum_steps = len(parts)
    norm_start_s = backward_done_s
    optimizer_start_s = norm_start_s + costs.grad_norm_s
    if costs.grad_norm_s > 0:
        out.append(("reduce-scatter", norm_start_s, optimizer_start_s, "norm", grad_accum_steps))
    if gpu_adam_s > 0:
        out.append(("compute", optimizer_start_s, optimizer_start_s + gpu_adam_s, "adam", grad_accum_steps))
    if cpu_adam_s > 0:
        cpu_start_s = optimizer_start_s + (gpu_adam_s if serial_optimizers else 0.0)
        out.append(("cpu optimizer", cpu_start_s, cpu_start_s + cpu_adam_s, "adam", grad_accum_steps))
    return out
