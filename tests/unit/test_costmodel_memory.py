"""Chunk packing, the chunk trace and memory accounting, on hand-computed cases."""

from __future__ import annotations

import pytest

from elixir_tune.costmodel.layout import pack_chunks
from elixir_tune.costmodel.memory import (
    activation_bytes,
    estimate_memory,
    model_state_bytes,
    unseen_grad_bytes,
    untraced_step_bytes,
)
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.costmodel.trace import BACKWARD, FORWARD, RECOMPUTE, checkpointed_trace, chunk_trace, forward_length
from elixir_tune.profiler.schema import ActivationLine, BlockInfo, ModelProfile, ParamInfo


def small_profile(frozen: bool = False) -> ModelProfile:
    """emb (shared, 100) -> a (60) -> b (50) -> c (40, frozen or not) -> head (shares emb)."""
    params = [
        ParamInfo("emb", [10, 10], "float32", 100, shared=True),
        ParamInfo("a", [60], "float32", 60),
        ParamInfo("b", [50], "float32", 50),
        ParamInfo("c", [40], "float32", 40, requires_grad=not frozen),
    ]
    forward = [[0], [1], [2], [3], [0]]
    blocks = [BlockInfo(0, 1, 1, 10.0, 1000, 100), BlockInfo(1, 2, 1, 10.0, 1000, 100)]
    return ModelProfile(
        name="small",
        source="small.py",
        fingerprint="f",
        num_params=250,
        dtype="bf16",
        batch_size=1,
        seq_len=4,
        params=params,
        trace=forward + forward[::-1],
        flops_per_sample=1e3,
        activation=ActivationLine(1000, 400),
        activation_checkpointed=ActivationLine(1000, 100),
        blocks=blocks,
        block_list="layers",
        recompute_flops_per_sample=20.0,
        buffers_bytes=64,
    )


def test_model_state_bytes_follow_the_plan_formula():
    states = model_state_bytes(
        chunk_size=1024,
        world_size=4,
        dtype="bf16",
        cache_blocks=3,
        num_resident=1,
        num_device_shards=5,
        num_host_shards=2,
    )
    assert states == {
        "cache_bytes": 3 * 1024 * 2,
        "resident_bytes": 1 * 1024 * 2,
        "device_shard_bytes": 5 * 256 * 16,
        "host_shard_bytes": 2 * 256 * 16,
    }


def test_packing_is_greedy_in_first_use_order_and_shared_params_are_resident():
    layout = pack_chunks(small_profile(), chunk_size=120)
    assert [(c.params, c.numel, c.resident) for c in layout.chunks] == [
        ([0], 100, True),
        ([1, 2], 114, False),  # b starts at 64, a multiple of 8 elements: 64 + 50
        ([3], 40, False),
    ]
    assert layout.chunk_of_param == [0, 1, 1, 2]
    # Without room for the padding, b moves to a chunk of its own.
    assert [c.params for c in pack_chunks(small_profile(), chunk_size=112).chunks] == [[0], [1], [2, 3]]
    with pytest.raises(ValueError):
        pack_chunks(small_profile(), chunk_size=99)


def test_frozen_parameters_go_into_frozen_chunks_of_their_own():
    profile = small_profile(frozen=True)
    layout = pack_chunks(profile, chunk_size=120)
    # c (frozen) would fit beside b, but a chunk holds frozen parameters only or trainable ones only.
    assert [(c.params, c.numel, c.resident, c.frozen) for c in layout.chunks] == [
        ([0], 100, True, False),
        ([1, 2], 114, False, False),
        ([3], 40, False, True),
    ]
    assert layout.frozen_numel == 40 and layout.chunk_of_param[3] == 2 and layout.num_frozen == 1


def test_frozen_chunks_hold_compute_dtype_weights_only():
    profile = small_profile(frozen=True)
    common = dict(
        chunk_size=120, world_size=2, gpus_per_node=2, dtype="bf16", cache_blocks=1, num_resident=1,
        num_chunks=3, frozen_numel=0, micro_batch_size=2, every=0, allocator_overhead_bytes=0,
        largest_param_numel=60, num_frozen=1,
    )  # fmt: skip
    # Two trainable shards (the resident chunk's and a+b's) at 16 bytes per element, and the frozen
    # chunk's: 60 elements x 2 bytes (bf16), no master/grad/Adam.
    on_device = estimate_memory(profile, num_offloaded=0, **common)
    assert on_device.model_state_bytes["device_shard_bytes"] == 2 * 60 * 16 + 60 * 2
    assert on_device.model_state_bytes["host_shard_bytes"] == 0
    assert on_device.transient_bytes["landing_bytes"] == 0
    # Offloaded: the shard is on the host and is itself the upload copy (no second copy, no landing
    # buffers: it has no gradient).
    offloaded = estimate_memory(profile, num_offloaded=1, num_frozen_offloaded=1, **common)
    assert offloaded.model_state_bytes["device_shard_bytes"] == 2 * 60 * 16
    assert offloaded.model_state_bytes["host_shard_bytes"] == 60 * 2
    assert offloaded.transient_bytes["landing_bytes"] == 0
    assert offloaded.transient_bytes["host_copy_bytes"] == 128 - 120  # pinned (cuda): rounded to a power of two
    assert on_device.peak_gpu_bytes - offloaded.peak_gpu_bytes == 60 * 2


def test_frozen_parameters_outside_chunks_are_counted_on_the_device():
    profile = small_profile(frozen=True)
    memory = estimate_memory(
        profile,
        chunk_size=120,
        world_size=2,
        gpus_per_node=2,
        dtype="bf16",
        cache_blocks=1,
        num_resident=1,
        num_chunks=2,
        num_offloaded=1,
        frozen_numel=40,
        micro_batch_size=2,
        every=0,
        allocator_overhead_bytes=1000,
        largest_param_numel=50,
    )
    # cache 1*120*2 + resident 120*2 + one device shard 60*16 + staging 2 x (chunk 120 + shard 60) x 2
    # + frozen 40*2 + activations 1000+2*400 + buffers 64 + gradients in flight 2 x 50 x 4 (fp32 width)
    # + the micro-batch's tokens and the step counters the profile does not trace
    untraced = untraced_step_bytes(profile, micro_batch_size=2, every=0, activation_copies=1)
    assert untraced == 2 * profile.seq_len * 8 * max(1, len(profile.inputs)) + 4 * len(profile.params) + 16 * 512
    assert memory.peak_gpu_bytes == 240 + 240 + 960 + 720 + 80 + 1800 + 64 + 400 + untraced
    assert memory.transient_bytes["staging_bytes"] == 720
    # kept free: 1 GiB (more than 5% of an unknown device and the probe's 1000) + NCCL's buffers
    assert memory.margin_bytes == (1 << 30) + (512 << 20)
    assert memory.required_gpu_bytes == memory.peak_gpu_bytes + memory.margin_bytes
    # host, per rank: one shard 60*16, its bf16 upload copy 60*2 and two bf16 landing shards 2*60*2,
    # pinned, so rounded to 128 and 256; two ranks per node.
    assert memory.transient_bytes["host_copy_bytes"] == 128 and memory.transient_bytes["landing_bytes"] == 256
    assert memory.peak_host_bytes == 2 * (960 + 128 + 256)
    assert memory.model_state_bytes["host_shard_bytes"] == 960


def test_cpu_device_pins_nothing_and_keeps_a_cpu_sized_margin():
    profile = small_profile()
    common = dict(
        chunk_size=120, world_size=2, gpus_per_node=2, dtype="fp32", cache_blocks=1, num_resident=1,
        num_chunks=2, num_offloaded=1, frozen_numel=0, micro_batch_size=2, every=0, allocator_overhead_bytes=0,
        prefetch=1, device="cpu", device_memory_bytes=16 << 30,
    )  # fmt: skip
    memory = estimate_memory(profile, **common)
    # fp32: the offloaded master is what goes up (no copy); no landing buffers (one memory).
    assert memory.transient_bytes == {
        "staging_bytes": 2 * 180 * 4,
        "host_copy_bytes": 0,
        "landing_bytes": 0,
        "held_grad_bytes": 0,
    }
    # 5% of 16 GiB, plus gloo's gather buffers (prefetch 1 + 2) x 120 x 4.
    assert memory.margin_bytes == int(0.05 * (16 << 30)) + 3 * 480


def test_activation_line_interpolates_by_checkpointed_blocks_and_scales_with_dtype():
    profile = small_profile()
    assert activation_bytes(profile, 2, 0, "bf16") == 1800
    assert activation_bytes(profile, 2, 1, "bf16") == 1200
    assert activation_bytes(profile, 2, 2, "bf16") == 1500  # blocks 0 of 2 checkpointed: half way
    assert activation_bytes(profile, 2, 0, "fp32") == 3600


def test_a_cpu_device_keeps_the_attention_scores_of_blocks_with_dropout():
    """Blocks of 50 and 30 score elements per sample whose attention has dropout: on a CPU device every
    block that keeps its activations keeps them (14 B each in fp32, 15 in bf16), a checkpointed one only
    while it recomputes (the largest, once); a GPU keeps none."""
    from dataclasses import replace

    from elixir_tune.costmodel.memory import cpu_attention_dropout_bytes

    profile = small_profile()
    profile = replace(
        profile, blocks=[replace(b, dropout_scores_per_sample=n) for b, n in zip(profile.blocks, (50, 30), strict=True)]
    )
    assert cpu_attention_dropout_bytes(profile, 2, 0, "fp32") == 2 * 80 * 14
    assert cpu_attention_dropout_bytes(profile, 2, 0, "bf16") == 2 * 80 * 15
    assert cpu_attention_dropout_bytes(profile, 2, 1, "fp32") == 2 * 50 * 14  # all recompute: one at a time
    assert cpu_attention_dropout_bytes(profile, 2, 2, "fp32") == 2 * 80 * 14  # one of two: capped at all kept
    assert activation_bytes(profile, 2, 0, "fp32", "cpu") == activation_bytes(profile, 2, 0, "fp32") + 2 * 80 * 14
    assert activation_bytes(profile, 2, 0, "fp32", "cuda") == activation_bytes(profile, 2, 0, "fp32")
    assert cpu_attention_dropout_bytes(small_profile(), 2, 0, "fp32") == 0  # no dropout (or an older profile)


def test_forward_length_finds_the_mirror():
    assert forward_length(small_profile().trace) == 5


def test_checkpointed_trace_recomputes_each_chosen_block_before_its_backward():
    profile = gpt2_profile("gpt2-tiny")
    plain = [s for s, _ in checkpointed_trace(profile, 0)]
    assert plain == [s for s in profile.trace if s]
    full = checkpointed_trace(profile, 1)
    kinds = [k for _, k in full]
    per_block = profile.blocks[0].num_params // 2  # weight + bias per module
    assert kinds.count(RECOMPUTE) == per_block * len(profile.blocks)
    every_other = checkpointed_trace(profile, 2)
    assert [k for _, k in every_other].count(RECOMPUTE) == per_block  # block 0 only of 2
    first_recompute = kinds.index(RECOMPUTE)
    assert set(kinds[: forward_length(profile.trace)]) == {FORWARD} and kinds[first_recompute - 1] == BACKWARD


def test_chunk_trace_merges_steps_that_cannot_miss():
    profile = small_profile()
    layout = pack_chunks(profile, chunk_size=120)
    trace = chunk_trace(profile, layout, every=0)
    # emb is resident, a and b share chunk 1: forward [], [1], [2], backward [2], [1], [].
    assert trace.steps == [(), (1,), (2,), (1,)]
    assert abs(sum(trace.flops_share) - 1.0) < 1e-12
    assert trace.last_use[0] == 3 and trace.last_use[1] == 3 and trace.last_use[2] == 2
    assert trace.max_step_chunks == 1


def test_gradients_in_flight_are_added_only_where_the_line_cannot_hold_them():
    """The profile's meter counts each gradient until its post-accumulate hook (profiler/profile.py): a whole
    model's fp32 line holds them; a low-precision kernel's fp32 workspace and a rank's share of a line do not."""
    assert unseen_grad_bytes("fp32", whole_model_line=True) == 0
    assert unseen_grad_bytes("bf16", whole_model_line=True) == 4
    assert unseen_grad_bytes("fp32", whole_model_line=False) == 4
    profile = gpt2_profile("gpt2")
    common = dict(
        chunk_size=1 << 24, world_size=2, gpus_per_node=2, dtype="fp32", cache_blocks=2, num_resident=0,
        num_chunks=8, num_offloaded=0, frozen_numel=0, micro_batch_size=2, every=0, allocator_overhead_bytes=0,
        largest_param_numel=50257 * 768,
    )  # fmt: skip
    whole = estimate_memory(profile, whole_model_line=True, **common)
    share = estimate_memory(profile, **common)
    assert share.buffer_bytes - whole.buffer_bytes == 2 * 50257 * 768 * 4
