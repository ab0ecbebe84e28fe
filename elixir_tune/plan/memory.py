"""What the engine holds beside the model states: one formula for the engine and the cost model.

``Engine.memory_report()`` and ``Prediction.transient_bytes`` use these keys, and a test compares
them. Sizes are per rank.

    staging_bytes    device: ``staging_buffers`` gradient buffers of one chunk each, plus (world > 1)
                     the reduce-scatter output shard of each, compute dtype
    host_copy_bytes  host: compute-dtype copies of the offloaded master shards, the bytes that cross
                     the host->device link, pinned on cuda, in one block; in fp32 the masters
                     themselves live in that block and are uploaded, so only its rounding counts here
    landing_bytes    host: ``staging_buffers`` shards in compute dtype that reduced gradients of
                     offloaded chunks land in before they are added into the fp32 host gradient;
                     pinned on cuda, in one block; beside it, on cuda, each offloaded trainable
                     expert chunk's own landing shard (its shard, over the expert-data group, is
                     E times the pool's), a pinned block each; none on a cpu device (one memory:
                     the reduced shard is added from the staging buffer)
    held_grad_bytes  device, pipeline plans with several micro-batches per step: the gradients a
                     stage holds unsharded in compute dtype (no-sync, ``param.grad``) from a
                     parameter's first micro-batch backward to its last, at the step's peak: under
                     ``looped_bfs`` (the search's schedule) the largest virtual stage's trainable
                     parameters (``engine/parallel/pipeline.py`` ``Pipeline.held_grad_bytes`` for every schedule)

Pinned blocks come from the CUDA host caching allocator, which rounds each block up to a power of
two (``pinned_bytes``).
"""

from __future__ import annotations

from typing import get_args

from elixir_tune.plan.schema import DTYPE_BYTES, TransientKey

TRANSIENT_KEYS: tuple[str, ...] = get_args(TransientKey)
DEVICE_TRANSIENT_KEYS = ("staging_bytes", "held_grad_bytes")
HOST_TRANSIENT_KEYS = ("host_copy_bytes", "landing_bytes")


def pinned_bytes(nbytes: int, pinned: bool) -> int:
    """Bytes a host block of ``nbytes`` really takes: a power of two when it is pinned (CUDA)."""
    if not pinned or nbytes <= 0:
        return max(nbytes, 0)
    return 1 << (nbytes - 1).bit_length()


def transient_bytes(
    chunk_size: int,
    world_size: int,
    dtype: str,
    staging_buffers: int,
    num_offloaded: int,
    pinned: bool,
    held_grad_numel: int = 0,
    device_is_host: bool = False,
    num_frozen_offloaded: int = 0,
    own_landing_numels: tuple[int, ...] = (),
) -> dict[str, int]:
    """The engine's buffers beside the model states, keys ``TRANSIENT_KEYS``.

    Args:
        chunk_size: elements per chunk.
        world_size: data-parallel size.
        dtype: compute dtype.
        staging_buffers: the plan's gradient staging pool size.
        num_offloaded: chunks whose shard lives on the host.
        pinned: host buffers are pinned (the device is cuda).
        held_grad_numel: gradient elements a pipeline stage holds unsharded at the step's peak (0
            without a pipeline or with one micro-batch per step).
        device_is_host: the device is the CPU (no landing buffers).
        num_frozen_offloaded: frozen chunks among ``num_offloaded``: their upload copy is their
            only copy of the weights (counted in host_shard_bytes), and they have no gradients
            to land.
        own_landing_numels: elements of each landing buffer of its own (an offloaded trainable
            expert chunk's shard on cuda: ``engine/chunks/chunk.py``).

    Returns:
        Bytes per key.
    """
    item = DTYPE_BYTES[dtype]
    shard_numel = chunk_size // world_size
    out_numel = shard_numel if world_size > 1 else 0
    host_copy = num_offloaded * shard_numel * item
    # Counted in host_shard_bytes: the masters in fp32, and the frozen shards in any dtype.
    masters_inside = host_copy if dtype == "fp32" else num_frozen_offloaded * shard_numel * item
    landing = staging_buffers * shard_numel * item if num_offloaded > num_frozen_offloaded and not device_is_host else 0
    own_landing = 0 if device_is_host else sum(pinned_bytes(numel * item, pinned) for numel in own_landing_numels)
    return {
        "staging_bytes": staging_buffers * (chunk_size + out_numel) * item,
        "host_copy_bytes": pinned_bytes(host_copy, pinned) - masters_inside,
        "landing_bytes": pinned_bytes(landing, pinned) + own_landing,
        "held_grad_bytes": held_grad_numel * item,
    }


# --- alignment --------------------------------------------------------------------------------

# Every parameter starts at a multiple of 8 elements inside its chunk (16 bytes in bf16/fp16, 32 in
# fp32), as FSDP pads, so that kernels see aligned views; chunk sizes are multiples of 8 x the
# world size, so that every rank's shard starts aligned too. The cost model's packing, validate and
# the engine use these same helpers.
ALIGN_ELEMENTS = 8


def align_up(numel: int, multiple: int = ALIGN_ELEMENTS) -> int:
    """``numel`` rounded up to a multiple of ``multiple``."""
    return -(-numel // multiple) * multiple


def padded_offsets(numels: list[int]) -> tuple[list[int], int]:
    """Offsets of parameters packed in order with aligned starts, and the elements they span.

    Args:
        numels: elements of each parameter, in packing order.

    Returns:
        (offsets, end): each parameter's first element, and where the last one ends (the chunk's
        ``numel``: the last parameter needs no padding after it).
    """
    offsets, end = [], 0
    for numel in numels:
        start = align_up(end)
        offsets.append(start)
        end = start + numel
    return offsets, end


def chunk_size_multiple(world_size: int) -> int:
    """What a chunk size must be a multiple of for every shard to start aligned."""
    return world_size * ALIGN_ELEMENTS
