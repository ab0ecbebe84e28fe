"""Memory accounting: peak device memory of one rank and peak host memory of one node.

The model-state part follows the formula of ``elixir_tune.plan.schema`` (MODEL_STATE_KEYS) to the
byte, because the engine reports the same keys and a test compares them:

    cache_bytes        = cache_blocks * chunk_size * dtype_bytes
    resident_bytes     = resident chunks * chunk_size * dtype_bytes
    device_shard_bytes = shards on the device * (chunk_size / world) * 16   (Adam)
    host_shard_bytes   = shards on the host   * (chunk_size / world) * 16

The rest of the device peak is frozen parameters, activations at the micro-batch size (a line
from the profile, interpolated by blocks for every-k checkpointing), model buffers, one chunk of
gradient staging for the reduce-scatter, and the allocator overhead the probe measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elixir_tune.plan.schema import DTYPE_BYTES, SHARD_BYTES_PER_ELEMENT
from elixir_tune.profiler.schema import ModelProfile

SHARD_BYTES = SHARD_BYTES_PER_ELEMENT["adam"]
# The reduce-scatter reads a chunk of compute-dtype gradients while the next one fills.
GRAD_BUFFER_CHUNKS = 1
# Per rank on the host: one fp32 shard landing from the device and one going up.
HOST_STAGING_SHARDS = 2


def model_state_bytes(
    chunk_size: int,
    world_size: int,
    dtype: str,
    cache_blocks: int,
    num_resident: int,
    num_device_shards: int,
    num_host_shards: int,
) -> dict[str, int]:
    """The four model-state parts of one rank (keys of MODEL_STATE_KEYS).

    Args:
        chunk_size: elements per chunk.
        world_size: data-parallel size.
        dtype: compute dtype.
        cache_blocks: gathered non-resident chunks held at once.
        num_resident: resident chunks.
        num_device_shards: chunks whose shard lives on the device.
        num_host_shards: chunks whose shard lives on the host.

    Returns:
        Bytes per key.
    """
    chunk_bytes = chunk_size * DTYPE_BYTES[dtype]
    shard_bytes = chunk_size // world_size * SHARD_BYTES
    return {
        "cache_bytes": cache_blocks * chunk_bytes,
        "resident_bytes": num_resident * chunk_bytes,
        "device_shard_bytes": num_device_shards * shard_bytes,
        "host_shard_bytes": num_host_shards * shard_bytes,
    }


def checkpointed_blocks(num_blocks: int, every: int) -> int:
    """How many of ``num_blocks`` blocks recompute with every-k checkpointing."""
    return 0 if every <= 0 else math.ceil(num_blocks / every)


def activation_bytes(profile: ModelProfile, micro_batch_size: int, every: int, dtype: str) -> int:
    """Peak activation memory of one micro-batch.

    Args:
        profile: the model profile (activation lines at its own dtype).
        micro_batch_size: samples per micro-batch.
        every: checkpointing (0 none, k every k-th block).
        dtype: compute dtype (activations scale with its size).

    Returns:
        Bytes.
    """
    plain: float = profile.activation.at(micro_batch_size)
    full = profile.activation_checkpointed
    if every > 0 and full is not None and profile.blocks:
        share = checkpointed_blocks(len(profile.blocks), every) / len(profile.blocks)
        plain = plain + (full.at(micro_batch_size) - plain) * share
    return int(plain * DTYPE_BYTES[dtype] / DTYPE_BYTES.get(profile.dtype, DTYPE_BYTES[dtype]))


@dataclass
class MemoryEstimate:
    """Peak memory of one candidate.

    Attributes:
        model_state_bytes: keys of MODEL_STATE_KEYS, one rank.
        frozen_bytes: frozen parameters, replicated on the device.
        activation_bytes: activations of one micro-batch.
        buffer_bytes: model buffers and gradient staging.
        overhead_bytes: allocator fragmentation and workspace (measured by the probe).
        peak_gpu_bytes: sum of the device parts.
        peak_host_bytes: host shards, their compute-dtype copies and staging of a whole node.
    """

    model_state_bytes: dict[str, int]
    frozen_bytes: int
    activation_bytes: int
    buffer_bytes: int
    overhead_bytes: int
    peak_gpu_bytes: int
    peak_host_bytes: int

    def device_parts(self) -> dict[str, int]:
        """Device memory by part, for display."""
        states = self.model_state_bytes
        return {
            "cache": states["cache_bytes"],
            "resident chunks": states["resident_bytes"],
            "optimizer shards": states["device_shard_bytes"],
            "frozen params": self.frozen_bytes,
            "activations": self.activation_bytes,
            "buffers": self.buffer_bytes,
            "allocator overhead": self.overhead_bytes,
        }


def estimate_memory(
    profile: ModelProfile,
    *,
    chunk_size: int,
    world_size: int,
    gpus_per_node: int,
    dtype: str,
    cache_blocks: int,
    num_resident: int,
    num_chunks: int,
    num_offloaded: int,
    frozen_numel: int,
    micro_batch_size: int,
    every: int,
    activation_copies: int = 1,
    allocator_overhead_bytes: int,
) -> MemoryEstimate:
    """Device and host peaks of one candidate.

    Args:
        profile: the model profile.
        chunk_size: elements per chunk.
        world_size: data-parallel size.
        gpus_per_node: ranks per node (they share the host).
        dtype: compute dtype.
        cache_blocks: cache size in chunks.
        num_resident: resident chunks.
        num_chunks: all chunks.
        num_offloaded: chunks whose shard lives on the host.
        frozen_numel: elements of frozen parameters.
        micro_batch_size: samples per micro-batch.
        every: checkpointing.
        activation_copies: micro-batches whose activations are held at once (layered accumulation
            keeps all of a step's: their block boundaries, and in backward the recomputed blocks of
            every micro-batch side by side).
        allocator_overhead_bytes: from the hardware spec.

    Returns:
        The estimate.
    """
    states = model_state_bytes(
        chunk_size, world_size, dtype, cache_blocks, num_resident, num_chunks - num_offloaded, num_offloaded
    )
    dtype_bytes = DTYPE_BYTES[dtype]
    frozen = frozen_numel * dtype_bytes
    activations = activation_copies * activation_bytes(profile, micro_batch_size, every, dtype)
    buffers = profile.buffers_bytes + GRAD_BUFFER_CHUNKS * chunk_size * dtype_bytes
    peak_gpu = (
        states["cache_bytes"]
        + states["resident_bytes"]
        + states["device_shard_bytes"]
        + frozen
        + activations
        + buffers
        + allocator_overhead_bytes
    )
    shard_numel = chunk_size // world_size
    host_per_rank = 0
    if num_offloaded:
        host_per_rank = (
            states["host_shard_bytes"]
            + num_offloaded * shard_numel * dtype_bytes
            + HOST_STAGING_SHARDS * shard_numel * 4
        )
    return MemoryEstimate(
        model_state_bytes=states,
        frozen_bytes=frozen,
        activation_bytes=activations,
        buffer_bytes=buffers,
        overhead_bytes=allocator_overhead_bytes,
        peak_gpu_bytes=peak_gpu,
        peak_host_bytes=host_per_rank * gpus_per_node,
    )
