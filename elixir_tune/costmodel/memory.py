"""Memory accounting: peak device memory of one rank and peak host memory of one node.

The model-state part follows the formula of ``elixir_tune.plan.schema`` (MODEL_STATE_KEYS) to the
byte, because the engine reports the same keys and a test compares them:

    cache_bytes        = cache_blocks * chunk_size * dtype_bytes
    resident_bytes     = resident chunks * chunk_size * dtype_bytes
    device_shard_bytes = shards on the device * (chunk_size / world) * 16   (Adam)
                         + frozen shards on the device * (chunk_size / world) * dtype_bytes
    host_shard_bytes   = the same for the shards on the host

A frozen chunk (a LoRA base model's parameters) holds its weights in the compute dtype only: no
fp32 master, gradient or optimizer state, and no reduction.

The engine's other buffers follow ``elixir_tune.plan.memory`` (TRANSIENT_KEYS), also to the byte:
the gradient staging pool on the device; the compute-dtype upload copies of offloaded shards and
the landing buffers of their gradients on the host, pinned (rounded to a power of two) on cuda; on a
pipeline rank with several micro-batches per step, the gradients its no-sync step holds unsharded
in compute dtype (``stage_profile.held_grad_numel``).

The rest of the device peak is frozen parameters outside the chunks (none in a searched plan),
activations at the micro-batch size (a line from the profile, interpolated by blocks for every-k
checkpointing; on a CPU device also the attention scores its math path keeps where the attention has
dropout, ``cpu_attention_dropout_bytes``), model buffers, the gradients autograd holds before the
engine copies them into the staging buffer where the line does not hold them (twice the largest
parameter at fp32 width, ``unseen_grad_bytes``), what the profile does not trace (the micro-batch's
tokens, checkpointing's saved generator states, Adam's step counters: ``untraced_step_bytes``), and on a
pipeline rank the receive buffers of every micro-batch (``stage_profile.recv_buffer_bytes``). That is
what a step allocates (``peak_gpu_bytes``). Beside it the search keeps a margin free (``margin_bytes``)
for what tensors do not show: allocator fragmentation and workspaces, and the buffers of the
communication library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from elixir_tune.costmodel.stage_profile import StageProfile
from elixir_tune.plan.memory import DEVICE_TRANSIENT_KEYS, HOST_TRANSIENT_KEYS, transient_bytes
from elixir_tune.plan.schema import DTYPE_BYTES, SHARD_BYTES_PER_ELEMENT
from elixir_tune.profiler.schema import ModelProfile, SelectiveLine

SHARD_BYTES = SHARD_BYTES_PER_ELEMENT["adam"]
# Parameter gradients autograd holds before the engine stages them: the outputs of one backward
# node arrive together, and a tied parameter's two contributions exist before they are summed.
GRADS_IN_FLIGHT = 2
# ... at fp32 width whatever the compute dtype: CPU kernels such as the embedding backward
# accumulate a bf16/fp16 gradient in fp32 before casting it (a workspace the meta-device profile
# cannot see).
GRAD_KERNEL_BYTES = 4


# Beside the line, three small things a step holds that the meta-device profile does not trace:
# the micro-batch's token tensors (int64 input ids, labels, masks: the meter takes the example batch as
# already there), the CPU generator state torch.utils.checkpoint saves per checkpointed call
# (preserve_rng_state; torch.get_rng_state() is 5056 bytes in torch 2.13; the engine checkpoints each
# recomputing block, engine/hooks.py), and Adam's step counter, a 0-dim fp32 tensor per parameter in
# torch's foreach and fused AdamW. And a fixed few 0-dim tensors of the engine's own: loss and
# finite flags between steps, the gradient norm's parts, the clip coefficient and found_inf during one
# (GPT-2 13M at world 2, tests/distributed/test_memory_fidelity.py: 22 bytes alive between steps and 104
# during one, beyond the rest; GPT-2 tiny at offload 0.5 and prefetch 2 measured steps 216 bytes apart,
# 700868 to 701084, as the upload thread's timing decides which coexist at the peak). On a GPU each
# 0-dim tensor takes one block of the caching allocator, 512 bytes at least; ENGINE_SCALARS counts them
# with room.
TOKEN_BYTES = 8
CPU_RNG_STATE_BYTES = 5056
STEP_COUNTER_BYTES = 4
ENGINE_SCALARS = 16
ALLOCATOR_BLOCK_BYTES = 512
ENGINE_SCALAR_BYTES = ENGINE_SCALARS * ALLOCATOR_BLOCK_BYTES


def untraced_step_bytes(profile: ModelProfile, micro_batch_size: int, every: int, activation_copies: int) -> int:
    """The micro-batch's tokens, the checkpointed blocks' saved generator states (one set per micro-batch
    whose activations are held), the optimizer's step counters and the engine's scalars (see ``TOKEN_BYTES``)."""
    tokens = micro_batch_size * profile.seq_len * TOKEN_BYTES * max(1, len(profile.inputs))
    rng = checkpointed_blocks(len(profile.blocks), every) * CPU_RNG_STATE_BYTES
    return activation_copies * (tokens + rng) + len(profile.params) * STEP_COUNTER_BYTES + ENGINE_SCALAR_BYTES


def unseen_grad_bytes(dtype: str, whole_model_line: bool) -> int:
    """Bytes per element of a gradient in flight that the activation line does not already hold.

    The profiler's meter counts every gradient autograd allocates, from its allocation until the
    parameter's post-accumulate hook drops it, as the engine takes it (``profiler/profile.py``). So a
    line traced on the whole model holds the gradients in flight at its peak, at the compute dtype,
    wherever in the step they coincide with the activations. It cannot see the fp32 workspace of a
    low-precision gradient kernel (``GRAD_KERNEL_BYTES``). A rank's share of a line (a pipeline stage,
    a tensor or context split) holds its share of them, while a gradient arrives whole
    (a 1d embedding's replicated table): there the whole gradient is counted on top, as before.
    Measured on GPT-2 shapes at fp32 (scripts/bench_memory_cpu.py): the step's peak above its start was
    the line to the MiB, with the embedding's 12.9M-element gradient inside it, not beside it.
    """
    if whole_model_line and dtype == "fp32":
        return 0
    return GRAD_KERNEL_BYTES


# The plan's default gradient staging pool.
STAGING_BUFFERS = 2
# Allocator margin on a GPU: at least 1 GiB or 5% of the device, whichever is larger (the caching
# allocator's fragmentation, cuBLAS/cuDNN workspaces).
GPU_MARGIN_MIN_BYTES = 1 << 30
GPU_MARGIN_SHARE = 0.05
# NCCL's own device buffers for one communicator (estimate: 4 MiB NCCL_BUFFSIZE per channel and
# protocol, tens of channels on NVLink/PCIe nodes), outside the caching allocator.
NCCL_BUFFER_BYTES = 512 << 20
# On a CPU device: what malloc and the interpreter keep around beyond live tensors.
CPU_MARGIN_MIN_BYTES = 256 << 20
CPU_MARGIN_SHARE = 0.05


def margin_bytes(
    device: str,
    device_memory_bytes: int,
    world_size: int,
    chunk_size: int,
    dtype: str,
    prefetch: int,
    allocator_overhead_bytes: int = 0,
    communicators: int | None = None,
) -> int:
    """Memory the search keeps free beside the predicted peak of one rank.

    Args:
        device: ``cuda`` or ``cpu``.
        device_memory_bytes: memory of one device (for a cpu device: its share of RAM).
        world_size: data-parallel size.
        chunk_size: elements per chunk.
        dtype: compute dtype.
        prefetch: gathers in flight beside the one in use.
        allocator_overhead_bytes: what the probe measured (a lower bound of the allocator part).
        communicators: groups of more than one rank this rank talks in (data, tensor, pipeline),
            each with its own library buffers (default: one when the data-parallel size is above 1).

    Returns:
        Bytes.
    """
    if communicators is None:
        communicators = 1 if world_size > 1 else 0
    if device == "cuda":
        margin = max(GPU_MARGIN_MIN_BYTES, int(GPU_MARGIN_SHARE * device_memory_bytes), allocator_overhead_bytes)
        return margin + NCCL_BUFFER_BYTES * communicators
    margin = max(CPU_MARGIN_MIN_BYTES, int(CPU_MARGIN_SHARE * device_memory_bytes), allocator_overhead_bytes)
    if world_size > 1:
        # gloo gathers into a flat buffer of its own and copies out (one per gather in flight),
        # and its reduce-scatter path all-reduces a whole chunk.
        margin += (prefetch + 2) * chunk_size * DTYPE_BYTES[dtype]
    return margin


def model_state_bytes(
    chunk_size: int,
    world_size: int,
    dtype: str,
    cache_blocks: int,
    num_resident: int,
    num_device_shards: int,
    num_host_shards: int,
    num_frozen_device_shards: int = 0,
    num_frozen_host_shards: int = 0,
) -> dict[str, int]:
    """The four model-state parts of one rank (keys of MODEL_STATE_KEYS).

    Args:
        chunk_size: elements per chunk.
        world_size: data-parallel size.
        dtype: compute dtype.
        cache_blocks: gathered non-resident chunks held at once.
        num_resident: resident chunks.
        num_device_shards: trainable chunks whose shard lives on the device.
        num_host_shards: trainable chunks whose shard lives on the host.
        num_frozen_device_shards: frozen chunks whose shard (compute-dtype weights) lives on the device.
        num_frozen_host_shards: frozen chunks whose shard lives on the host.

    Returns:
        Bytes per key.
    """
    chunk_bytes = chunk_size * DTYPE_BYTES[dtype]
    shard_bytes = chunk_size // world_size * SHARD_BYTES
    frozen_shard_bytes = chunk_size // world_size * DTYPE_BYTES[dtype]
    return {
        "cache_bytes": cache_blocks * chunk_bytes,
        "resident_bytes": num_resident * chunk_bytes,
        "device_shard_bytes": num_device_shards * shard_bytes + num_frozen_device_shards * frozen_shard_bytes,
        "host_shard_bytes": num_host_shards * shard_bytes + num_frozen_host_shards * frozen_shard_bytes,
    }


def node_host_peak_bytes(stage_host_bytes: list[int], gpus_per_node: int, nodes: int, tensor: int) -> int:
    """Host peak of the fullest node when pipeline stages hold different host bytes.

    Ranks are laid out data x pipeline x tensor (rank = (data_index x P + stage) x T + tensor_index)
    and a node holds G consecutive ranks, so a node holds ranks of several stages when G > T.

    Args:
        stage_host_bytes: per stage, the host peak of a node were all its ranks of that stage
            (``MemoryEstimate.peak_host_bytes``: one rank's host bytes x G).
        gpus_per_node: ranks per node (G).
        nodes: nodes.
        tensor: tensor-parallel degree (T).

    Returns:
        Bytes: the largest over nodes of the sum of its ranks' host bytes.
    """
    stages = len(stage_host_bytes)
    per_rank = [host // gpus_per_node for host in stage_host_bytes]
    return max(
        sum(per_rank[rank // tensor % stages] for rank in range(node * gpus_per_node, (node + 1) * gpus_per_node))
        for node in range(nodes)
    )


def selective_line(profile: ModelProfile) -> SelectiveLine:
    """The profile's selective-checkpointing figures, or a clear error where it has none."""
    if profile.selective is None:
        raise ValueError(
            f"the profile of {profile.name} has no selective-checkpointing figures (made before they were "
            "traced, by the analytic GPT-2 profile, or for a pipeline, tensor or context rank); profile the "
            "model again with `elixir-tune profile`, or checkpoint fully"
        )
    return profile.selective


def checkpointed_blocks(num_blocks: int, every: int) -> int:
    """How many of ``num_blocks`` blocks recompute with every-k checkpointing."""
    return 0 if every <= 0 else math.ceil(num_blocks / every)


# Bytes a CPU training step keeps per attention score element where the attention has dropout:
# torch's CPU flash kernel takes no dropout, so scaled_dot_product_attention runs its math path and
# keeps the softmax, the dropout noise and the dropped probabilities for backward. Measured with
# torch 2.13 on the CPU (saved-tensor hooks around one call, batch 2, 4 heads, seq 64, causal):
# 14.0 bytes per score element in fp32, 15.0 in bf16 and fp16; 0.06 without dropout (flash).
CPU_DROPOUT_ATTENTION_BYTES = {"fp32": 14, "bf16": 15, "fp16": 15}


def dtype_scale(profile: ModelProfile, dtype: str) -> float:
    """Bytes of ``dtype`` per byte of the profile's own dtype (its byte figures were traced in it)."""
    return DTYPE_BYTES[dtype] / DTYPE_BYTES.get(profile.dtype, DTYPE_BYTES[dtype])


def cpu_attention_dropout_bytes(profile: ModelProfile, micro_batch_size: int, every: int, dtype: str) -> int:
    """What a CPU device's attention keeps beyond the profile where the attention has dropout.

    The profile counts the fused kernels a GPU runs (``profiler/meta_kernels.py``); with dropout a CPU
    runs the math path instead, whose scores each block keeps for backward. Blocks that recompute
    (every-k checkpointing) keep none but the one recomputing in backward.

    Args:
        profile: the model profile (``BlockInfo.dropout_scores_per_sample``).
        micro_batch_size: samples per micro-batch.
        every: checkpointing (0 none, k every k-th block).
        dtype: compute dtype.

    Returns:
        Bytes (0 for a model without attention dropout, or a profile older than the field).
    """
    scores = [b.dropout_scores_per_sample for b in profile.blocks]
    if not any(scores):
        return 0
    share = checkpointed_blocks(len(scores), every) / len(scores)
    kept = min(sum(scores), sum(scores) * (1 - share) + (max(scores) if share else 0))
    return int(micro_batch_size * kept * CPU_DROPOUT_ATTENTION_BYTES[dtype])


def activation_bytes(
    profile: ModelProfile, micro_batch_size: int, every: int, dtype: str, device: str = "cuda", selective: bool = False
) -> int:
    """Peak activation memory of one micro-batch.

    Args:
        profile: the model profile (activation lines at its own dtype).
        micro_batch_size: samples per micro-batch.
        every: checkpointing (0 none, k every k-th block).
        dtype: compute dtype (activations scale with its size).
        device: ``cuda`` or ``cpu`` (a CPU keeps attention scores where the attention has dropout).
        selective: the checkpointed blocks keep torchtitan's per-op saves: the profile's line traced
            with that policy (``ModelProfile.selective``) stands for all blocks checkpointed.

    Returns:
        Bytes.

    Raises:
        ValueError: ``selective`` with a profile that has no selective line.
    """
    plain: float = profile.activation.at(micro_batch_size)
    full = profile.activation_checkpointed
    if selective and every > 0:
        full = selective_line(profile).activation
    if every > 0 and full is not None and profile.blocks:
        share = checkpointed_blocks(len(profile.blocks), every) / len(profile.blocks)
        plain = plain + (full.at(micro_batch_size) - plain) * share
    line = int(plain * dtype_scale(profile, dtype))
    if device == "cpu":
        line += cpu_attention_dropout_bytes(profile, micro_batch_size, every, dtype)
    return line


@dataclass
class MemoryEstimate:
    """Peak memory of one candidate.

    Attributes:
        model_state_bytes: keys of MODEL_STATE_KEYS, one rank.
        frozen_bytes: frozen parameters, replicated on the device.
        activation_bytes: activations of one micro-batch.
        buffer_bytes: model buffers and the gradient autograd hands over before staging.
        margin_bytes: kept free beside the peak (allocator, communication library).
        peak_gpu_bytes: what a step allocates on the device at its peak (the margin not included).
        peak_host_bytes: host shards, upload copies and landing buffers of a whole node.
        transient_bytes: the engine's buffers beside the model states, keys TRANSIENT_KEYS, one rank.
    """

    model_state_bytes: dict[str, int]
    frozen_bytes: int
    activation_bytes: int
    buffer_bytes: int
    margin_bytes: int
    peak_gpu_bytes: int
    peak_host_bytes: int
    transient_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def required_gpu_bytes(self) -> int:
        """Device memory a rank needs: the peak and the margin kept free beside it."""
        return self.peak_gpu_bytes + self.margin_bytes

    def device_parts(self) -> dict[str, int]:
        """Device memory by part, for display."""
        states = self.model_state_bytes
        return {
            "cache": states["cache_bytes"],
            "resident chunks": states["resident_bytes"],
            "optimizer shards": states["device_shard_bytes"],
            "gradient staging": self.transient_bytes.get("staging_bytes", 0),
            "held gradients (pipeline)": self.transient_bytes.get("held_grad_bytes", 0),
            "frozen params": self.frozen_bytes,
            "activations": self.activation_bytes,
            "buffers": self.buffer_bytes,
            "margin kept free": self.margin_bytes,
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
    allocator_overhead_bytes: int,
    prefetch: int = 0,
    staging_buffers: int = STAGING_BUFFERS,
    device: str = "cuda",
    device_memory_bytes: int = 0,
    largest_param_numel: int = 0,
    activation_copies: int = 1,
    micro_batches: int = 1,
    communicators: int | None = None,
    num_frozen: int = 0,
    num_frozen_offloaded: int = 0,
    own_landing_numels: tuple[int, ...] = (),
    selective: bool = False,
    whole_model_line: bool = False,
) -> MemoryEstimate:
    """Device and host peaks of one candidate.

    Args:
        profile: the model profile (a pipeline rank's ``StageProfile`` says what its no-sync step
            holds).
        chunk_size: elements per chunk.
        world_size: data-parallel size.
        gpus_per_node: ranks per node (they share the host).
        dtype: compute dtype.
        cache_blocks: cache size in chunks.
        num_resident: resident chunks.
        num_chunks: all chunks, frozen ones included.
        num_offloaded: chunks whose shard lives on the host, frozen ones included.
        frozen_numel: elements of frozen parameters outside the chunks (replicated on the device).
        micro_batch_size: samples per micro-batch.
        every: checkpointing.
        allocator_overhead_bytes: from the hardware spec (a lower bound of the allocator margin).
        prefetch: gathers issued ahead (gloo's gather buffers, in the margin).
        staging_buffers: the gradient staging pool.
        device: ``cuda`` (host buffers pinned, GPU margin) or ``cpu``.
        device_memory_bytes: memory of one device, for the margin.
        largest_param_numel: elements of the largest trainable parameter (gradients arrive whole
            before they are staged).
        activation_copies: micro-batches whose activations are held at once (layered accumulation
            keeps all of a step's: their block boundaries, and in backward the recomputed blocks of
            every micro-batch side by side; a pipeline stage what its schedule holds:
            ``parallel.held_activation_copies``).
        micro_batches: micro-batches per step. More than one on a pipeline rank means its step
            holds the stage's gradients unsharded until their last micro-batch, whatever the
            schedule and however few activations it holds.
        communicators: communication groups of the rank (``margin_bytes``).
        num_frozen: frozen chunks (compute-dtype weights only), among ``num_chunks``.
        num_frozen_offloaded: frozen chunks among ``num_offloaded``.
        own_landing_numels: elements of each host landing buffer of its own (``transient_bytes``).
        selective: the checkpointed blocks keep torchtitan's per-op saves (``activation_bytes``).
        whole_model_line: ``profile`` is the whole model's, not a rank's share (``unseen_grad_bytes``).

    Returns:
        The estimate.
    """
    states = model_state_bytes(
        chunk_size,
        world_size,
        dtype,
        cache_blocks,
        num_resident,
        num_chunks - num_offloaded - (num_frozen - num_frozen_offloaded),
        num_offloaded - num_frozen_offloaded,
        num_frozen - num_frozen_offloaded,
        num_frozen_offloaded,
    )
    # A pipeline step with several micro-batches holds gradients until each parameter's last one.
    held_numel = profile.held_grad_numel if isinstance(profile, StageProfile) and micro_batches > 1 else 0
    transients = transient_bytes(
        chunk_size,
        world_size,
        dtype,
        staging_buffers,
        num_offloaded,
        device == "cuda",
        held_numel,
        device_is_host=device == "cpu",
        num_frozen_offloaded=num_frozen_offloaded,
        own_landing_numels=own_landing_numels,
    )
    dtype_bytes = DTYPE_BYTES[dtype]
    frozen = frozen_numel * dtype_bytes
    activations = activation_copies * activation_bytes(profile, micro_batch_size, every, dtype, device, selective)
    unseen = unseen_grad_bytes(dtype, whole_model_line and not isinstance(profile, StageProfile))
    buffers = profile.buffers_bytes + GRADS_IN_FLIGHT * largest_param_numel * unseen
    buffers += untraced_step_bytes(profile, micro_batch_size, every, activation_copies)
    if isinstance(profile, StageProfile):  # a pipeline stage's receive buffers, one set per micro-batch
        buffers += int(
            micro_batches * micro_batch_size * profile.recv_buffer_bytes_per_sample * dtype_scale(profile, dtype)
        )
    peak_gpu = (
        states["cache_bytes"]
        + states["resident_bytes"]
        + states["device_shard_bytes"]
        + sum(transients[key] for key in DEVICE_TRANSIENT_KEYS)
        + frozen
        + activations
        + buffers
    )
    host_per_rank = states["host_shard_bytes"] + sum(transients[key] for key in HOST_TRANSIENT_KEYS)
    return MemoryEstimate(
        model_state_bytes=states,
        frozen_bytes=frozen,
        activation_bytes=activations,
        buffer_bytes=buffers,
        margin_bytes=margin_bytes(
            device,
            device_memory_bytes,
            world_size,
            chunk_size,
            dtype,
            prefetch,
            allocator_overhead_bytes,
            communicators,
        ),
        peak_gpu_bytes=peak_gpu,
        peak_host_bytes=host_per_rank * gpus_per_node,
        transient_bytes=transients,
    )
