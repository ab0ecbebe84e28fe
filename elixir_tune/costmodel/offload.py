"""Which shards go to the host first: the chunks whose offload costs the least time per device byte it frees.

Offloading a chunk's shard frees its device bytes and adds host-link and host work, which differ by kind:

* a trainable chunk frees its fp32 master, gradient and Adam moments (``SHARD_BYTES`` per element) and
  pays an upload per fetch (the compute-dtype copy), a copy down and a host add of its reduced gradient
  per backward pass, and Adam on the CPU instead of the device;
* a frozen chunk (a LoRA base, docs/finetune-data.md) frees its compute-dtype weights only and
  pays only the uploads: it is never reduced and has no optimizer state.

Each chunk's offload cost is the seconds it adds (over the counted passes and one optimizer step,
without overlap: the step simulation prices the overlap). The search tries two orders: the cheapest per
device byte freed first (a large need: trainable shards free 16 bytes per element, frozen ones 2 in bf16)
and the cheapest per chunk first (a small need: a frozen shard pays uploads only). Ties go to the fewest
fetches, then the last chunks first (their gradients are reduced earliest in backward, so their copies
overlap the most). For a model without frozen chunks every shard frees the same bytes, the cost rises with
the fetches alone, and the one order is the fewest fetches first, as before frozen chunks existed. An
expert chunk under expert parallelism has a shard E times a data-group shard (it is sharded over the
D / E ranks of its expert-data group): its offload frees E times the bytes, and its copies and host Adam
move E times the elements. The
step time (``CostModel.step_time``) and the memory (``estimate_memory``) price each kind as above; an
order only picks which chunks a count of offloaded shards means.
"""

from __future__ import annotations

from elixir_tune.costmodel.layout import ChunkLayout
from elixir_tune.costmodel.memory import SHARD_BYTES
from elixir_tune.costmodel.timeline import TransferCosts
from elixir_tune.plan.schema import DTYPE_BYTES


def offload_cost_s(
    frozen: bool, fetches: int, passes: int, shard_numel: int, costs: TransferCosts, adam_s_per_elem: float
) -> float:
    """Seconds one offloaded shard adds (copies and host work, no overlap counted).

    Args:
        frozen: the chunk holds frozen parameters (weights only).
        fetches: its fetches over the counted passes.
        passes: backward passes counted (each reduces a trainable chunk once).
        shard_numel: elements of the shard.
        costs: per-chunk operation times.
        adam_s_per_elem: host Adam's seconds per element minus the device's (what moving the update costs).

    Returns:
        The seconds.
    """
    uploads = fetches * costs.h2d_s
    if frozen:
        return uploads
    return uploads + passes * (costs.d2h_s + costs.host_add_s) + shard_numel * max(0.0, adam_s_per_elem)


def freed_bytes(layout: ChunkLayout, shard_numel: int, dtype: str, shard_weights: list[int] | None = None) -> list[int]:
    """Device bytes each chunk's offload frees: its shard's master, gradient and Adam moments
    (``SHARD_BYTES`` per element), or a frozen chunk's compute-dtype weights.

    Args:
        layout: the chunk layout.
        shard_numel: elements of one shard of the data group.
        dtype: the compute dtype (a frozen shard's bytes per element).
        shard_weights: each chunk's shard in data-group shards (an expert chunk's, sharded over the
            expert-data group, is E of them: ``RankExperts.shard_weights``); None: 1 each.

    Returns:
        Bytes per chunk id.
    """
    weights = shard_weights or [1] * layout.num_chunks
    return [
        weights[c] * shard_numel * (DTYPE_BYTES[dtype] if chunk.frozen else SHARD_BYTES)
        for c, chunk in enumerate(layout.chunks)
    ]


def offload_orders(
    layout: ChunkLayout,
    fetches: list[int],
    passes: int,
    shard_numel: int,
    dtype: str,
    costs: TransferCosts,
    adam_s_per_elem: float,
    chunk_costs: dict[int, TransferCosts] | None = None,
    shard_weights: list[int] | None = None,
) -> list[list[int]]:
    """Chunk ids in the orders their shards go to the host, the first one first.

    The first order ranks by the seconds an offload adds per device byte it frees: the order that frees
    a large need at the least cost. The second ranks by the seconds alone (a frozen shard's uploads cost
    less than a trainable one's uploads, copies down and host Adam, though it frees fewer bytes): the
    order that covers a small need at the least cost. Ties go to the fewest fetches, then the last chunks
    first. Without frozen chunks every shard frees the same bytes and the two orders are one.

    Args:
        layout: the chunk layout.
        fetches: each chunk's fetches over the counted passes.
        passes: the passes counted.
        shard_numel: elements of one shard of the data group.
        dtype: the compute dtype (a frozen shard's bytes per element).
        costs: per-chunk operation times.
        adam_s_per_elem: host Adam's seconds per element minus the device's.
        chunk_costs: operation times of the chunks whose shard differs from the data group's (expert
            chunks: ``RankExperts.chunk_costs``), by chunk id.
        shard_weights: each chunk's shard in data-group shards (``freed_bytes``).

    Returns:
        One or two orders, each of every chunk id once.
    """
    weights = shard_weights or [1] * layout.num_chunks
    chunk_costs = chunk_costs or {}
    cost_s = [
        offload_cost_s(
            layout.chunks[c].frozen,
            fetches[c],
            passes,
            weights[c] * shard_numel,
            chunk_costs.get(c, costs),
            adam_s_per_elem,
        )
        for c in range(layout.num_chunks)
    ]
    freed = freed_bytes(layout, shard_numel, dtype, weights)
    per_byte = sorted(range(layout.num_chunks), key=lambda c: (cost_s[c] / max(freed[c], 1), fetches[c], -c))
    per_chunk = sorted(range(layout.num_chunks), key=lambda c: (cost_s[c], fetches[c], -c))
    return [per_byte] if per_chunk == per_byte or not layout.num_frozen else [per_byte, per_chunk]


# A step whose host Adam is more than this share is "mostly host Adam": `show` says so and how the step
# moves with the rate (an offloaded 70B on 8 x H100 spends 24.4 s of 67.1 s there, 36%, on one preset rate).
HOST_ADAM_SHARE_SHOWN = 0.30
HOST_ADAM_RATE_FACTORS = (0.5, 2.0)


def host_adam_share(breakdown: dict[str, float], step_time_s: float) -> float:
    """The share of the step that host Adam (``optimizer_cpu_s``) takes (0 for a step of 0 s)."""
    return breakdown.get("optimizer_cpu_s", 0.0) / step_time_s if step_time_s > 0 else 0.0


def step_at_host_adam_rate(
    breakdown: dict[str, float], step_time_s: float, factor: float, serial_optimizers: bool
) -> float:
    """The step with the host Adam rate times ``factor``, as ``timeline.combine_step`` composes it.

    The optimizer follows the backward: the device's and the host's Adam run side by side (one after the
    other when the device is the CPU itself, ``serial_optimizers``), so the step moves by what the longer
    of the two (their sum) moves. Only the optimizer moves: the host's gradient adds during backward, priced
    at the same rate (``timeline.TransferCosts``) and mostly hidden behind the compute, stay as they are.

    Args:
        breakdown: the step's parts (``optimizer_gpu_s``, ``optimizer_cpu_s``).
        step_time_s: the predicted step.
        factor: the host Adam rate over the one predicted with (0.5: half as fast).
        serial_optimizers: the device is the CPU.

    Returns:
        Seconds.
    """
    gpu_s, cpu_s = breakdown.get("optimizer_gpu_s", 0.0), breakdown.get("optimizer_cpu_s", 0.0)

    def optimizer_s(host_s: float) -> float:
        return gpu_s + host_s if serial_optimizers else max(gpu_s, host_s)

    return step_time_s - optimizer_s(cpu_s) + optimizer_s(cpu_s / factor)
