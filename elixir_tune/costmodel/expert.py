"""Expert parallelism in the cost model (engine/parallel/expert_parallel.py): which parameters are
expert tensors, and what the token exchange costs one rank.

**Traffic.** Each mixture-of-experts block sends every (token, chosen expert) row of this rank's
micro-batch to the rank holding that expert and gets the output row back: two all-to-alls forward
(dispatch, return) and the same two backward (their gradients), plus, forward, one small all-to-all
of the per-expert counts. A checkpointed block runs its forward again in backward: three more. With
routing spread evenly over the E ranks of the expert group, a fraction (E - 1) / E of the rows
leaves the rank, so one all-to-all moves

    (E - 1) / E x tokens x top_k x hidden x bytes per element

out of each rank (and as much in). Skewed routing moves more to the busiest rank; the even split is
the figure the search compares layouts by.

**Links.** The expert group is E consecutive data ranks: while E fits in a node the rows ride the
node's GPU links (``allgather_gbps``); a wider group sends (E - G) / E of them off the node (G GPUs
per node) over ``inter_node_gbps``, the rest on the node's links at the same time, and the slower
of the two is the time.

**Where it shows.** The engine calls the all-to-alls synchronously on the compute stream (the
counts are even copied to the host to size the rows), so nothing overlaps them: their time is
added to every micro-batch's compute, as tensor-parallel collectives are.

**Memory and chunks.** A rank holds 1/E of every expert tensor (``[experts / E, ...]``) in chunks
of their own, sharded over the expert-data group (D / E data ranks) instead of the D data ranks: a
shard of an expert chunk is E times a shard of another chunk, its all-gather and reduce-scatter run
over D / E ranks (none when E = D), and the per-rank model state of the experts is the same as
without expert parallelism (X / E elements over D / E ranks = X / D), while the gathered working
set (cache blocks) holds only this rank's experts. An offloaded expert chunk therefore moves E data
shards' bytes to the host (master, gradient, Adam moments and its upload copy), and its copies and host
Adam move E times the elements (``shard_weights``). Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from elixir_tune.costmodel.layout import ChunkLayout
from elixir_tune.costmodel.timeline import TransferCosts, transfer_costs
from elixir_tune.hardware.spec import HardwareSpec
from elixir_tune.plan.capabilities import EXPERT_PARALLEL_RUNS_WITH, is_expert_param
from elixir_tune.profiler.schema import ModelProfile

__all__ = [
    "RankExperts",
    "expert_all_to_all_bytes",
    "expert_all_to_all_s",
    "expert_param_indices",
    "moe_block_count",
]

# All-to-alls of rows per block and micro-batch: dispatch and return forward, their gradients backward.
ALL_TO_ALLS_PER_BLOCK = 4
# Of which run in forward (again for a checkpointed block's recomputation).
FORWARD_ALL_TO_ALLS = 2
# The per-expert counts exchanged before each forward dispatch (latency only: X integers).
COUNT_EXCHANGES_PER_FORWARD = 1


def expert_param_indices(profile: ModelProfile) -> frozenset[int]:
    """Indices of the profile's expert tensors: parameters of an ``experts`` module whose first
    dimension is the experts per block (``arch.num_experts``, recorded when the config ships an
    expert plan; none otherwise)."""
    experts = profile.arch.num_experts
    if experts <= 0:
        return frozenset()
    return frozenset(
        index
        for index, param in enumerate(profile.params)
        if is_expert_param(param.name) and param.shape and param.shape[0] == experts
    )


def moe_block_count(profile: ModelProfile, indices: frozenset[int]) -> int:
    """Blocks of ``profile`` that hold at least one of the parameters ``indices``."""
    return sum(
        1
        for block in profile.blocks
        if any(i in indices for i in range(block.first_param, block.first_param + block.num_params))
    )


@dataclass(frozen=True)
class RankExperts:
    """One rank's experts under expert degree E (E = 1: none).

    Attributes:
        degree: E.
        replicas: ranks of the expert-data group (D / E), which shard and reduce the expert chunks.
        params: indices of the expert tensors in the rank's profile (``stage_profile.rank_profile``).
        moe_blocks: indices of the rank's blocks that hold experts.
    """

    degree: int = 1
    replicas: int = 1
    params: frozenset[int] = frozenset()
    moe_blocks: frozenset[int] = frozenset()

    @classmethod
    def of(cls, full: ModelProfile, rank: ModelProfile, degree: int, data_size: int) -> RankExperts:
        """The experts of ``rank`` (one rank's view of ``full``) at expert degree ``degree`` and data size D."""
        if degree <= 1:
            return cls()
        names = {full.params[i].name for i in expert_param_indices(full)}
        # By name: a pipeline stage keeps a subset of the parameters, in order.
        params = frozenset(i for i, p in enumerate(rank.params) if p.name in names)
        blocks = frozenset(
            b.index for b in rank.blocks if any(i in params for i in range(b.first_param, b.first_param + b.num_params))
        )
        return cls(degree, max(1, data_size // degree), params, blocks)

    def shard_units(self, layout: ChunkLayout) -> int:
        """The layout's chunks counted in shards of the data group's size: an expert chunk's shard
        (over D / E ranks) is E of them."""
        return layout.num_chunks + (self.degree - 1) * layout.num_expert

    def shard_weights(self, layout: ChunkLayout) -> list[int]:
        """Each chunk's shard in shards of the data group's size: E for an expert chunk, 1 otherwise.
        Where the shard lives (device or host) it holds that many data shards' bytes."""
        return [self.degree if chunk.expert else 1 for chunk in layout.chunks]

    def landing_numels(self, layout: ChunkLayout, offloaded: list[bool], shard_numel: int) -> tuple[int, ...]:
        """Elements of the host landing buffer each offloaded trainable expert chunk holds of its own on
        cuda (its reduced shard, E data shards: the staging pool's are cut for the data group)."""
        if not layout.num_expert:  # read for every candidate: most layouts have no expert chunk
            return ()
        return tuple(
            self.degree * shard_numel
            for c, chunk in enumerate(layout.chunks)
            if chunk.expert and not chunk.frozen and offloaded[c]
        )

    def shards_of(self, layout: ChunkLayout, chunks: list[int]) -> int:
        """The data-group shards that the shards of ``chunks`` (ids in ``layout``) hold together."""
        return sum(self.degree if layout.chunks[c].expert else 1 for c in chunks)

    def offloadable(self, layout: ChunkLayout) -> int:
        """Chunks whose shard may go to the host: all but the expert chunks where the engine keeps
        those on the device (``capabilities.EXPERT_PARALLEL_RUNS_WITH``)."""
        return layout.num_chunks - (0 if EXPERT_PARALLEL_RUNS_WITH["offloaded_experts"] else layout.num_expert)

    def chunk_costs(
        self, layout: ChunkLayout, hardware: HardwareSpec, gpus_per_node: int, nodes: int, dtype: str
    ) -> dict[int, TransferCosts]:
        """Operation times of each expert chunk of ``layout``: its shard and collectives span the
        expert-data group (D / E ranks, across nodes when it has several ranks and the world spans
        nodes), not the data group; empty without expert chunks."""
        if not layout.num_expert:
            return {}
        costs = transfer_costs(
            hardware, layout.chunk_size, self.replicas, gpus_per_node, nodes if self.replicas > 1 else 1, dtype
        )
        return {c: costs for c, chunk in enumerate(layout.chunks) if chunk.expert}

    def movable(self, layout: ChunkLayout) -> list[int]:
        """Ids of the chunks that may be offloaded, in order."""
        keep = not EXPERT_PARALLEL_RUNS_WITH["offloaded_experts"]
        return [c for c, chunk in enumerate(layout.chunks) if not (keep and chunk.expert)]


def expert_all_to_all_bytes(
    degree: int, tokens: int, hidden_size: int, experts_per_token: int, moe_blocks: int, element_bytes: int
) -> int:
    """Bytes one rank sends in the all-to-alls of expert parallelism for one micro-batch (forward
    and backward, no recomputation; it receives as many).

    Args:
        degree: expert degree E (1: no traffic).
        tokens: tokens of the micro-batch (micro_batch_size x seq_len).
        hidden_size: the rows' width (the residual stream).
        experts_per_token: top-k of the router.
        moe_blocks: blocks with routed experts.
        element_bytes: bytes per element of the compute dtype.

    Returns:
        Bytes sent by this rank.
    """
    if degree <= 1:
        return 0
    rows_out = tokens * experts_per_token * (degree - 1) / degree
    return round(ALL_TO_ALLS_PER_BLOCK * moe_blocks * rows_out * hidden_size * element_bytes)


def expert_all_to_all_s(
    degree: int,
    tokens: int,
    hidden_size: int,
    experts_per_token: int,
    element_bytes: int,
    *,
    gpus_per_node: int,
    intra_node_bps: float,
    inter_node_bps: float,
    latency_s: float,
) -> tuple[float, float]:
    """Seconds of one MoE block's exchanges for one micro-batch: (forward + backward, a recomputed
    forward's).

    Args:
        degree: expert degree E (1: no exchange).
        tokens: tokens of the micro-batch.
        hidden_size: the rows' width.
        experts_per_token: top-k of the router.
        element_bytes: bytes per element of the compute dtype.
        gpus_per_node: G; a group of E > G ranks spans nodes.
        intra_node_bps: bytes per second on the node's GPU links.
        inter_node_bps: bytes per second per device between nodes.
        latency_s: fixed cost of one collective.

    Returns:
        (seconds of the forward and backward exchanges, seconds of one recomputed forward's).
    """
    if degree <= 1:
        return 0.0, 0.0
    row_bytes = tokens * experts_per_token * hidden_size * element_bytes
    on_node = min(degree, gpus_per_node)
    intra_s = row_bytes * (on_node - 1) / degree / intra_node_bps
    inter_s = row_bytes * (degree - on_node) / degree / inter_node_bps if degree > on_node else 0.0
    one_s = latency_s + max(intra_s, inter_s)
    forward_s = FORWARD_ALL_TO_ALLS * one_s + COUNT_EXCHANGES_PER_FORWARD * latency_s
    backward_s = (ALL_TO_ALLS_PER_BLOCK - FORWARD_ALL_TO_ALLS) * one_s
    return forward_s + backward_s, forward_s
