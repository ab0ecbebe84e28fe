"""The gradients a pipeline step holds unsharded (no-sync) in the cost model: ``stage_profile.held_grad_numel``
against numbers worked by hand, and the term in ``CostModel.memory`` and in the search's prediction; the
receive buffers of every micro-batch (``stage_profile.recv_buffer_bytes``) and the activations before the
first block (the prologue), which the first stage holds."""

from __future__ import annotations

import dataclasses

import pytest

from elixir_tune.costmodel.memory import estimate_memory
from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.costmodel.parallel import DATA_ONLY, Layout
from elixir_tune.costmodel.stage_profile import StageProfile, rank_profile
from elixir_tune.costmodel.synthetic import example_hardware, gpt2_profile
from elixir_tune.profiler.schema import ModelProfile
from elixir_tune.search import search

H, LAYERS, VOCAB, POSITIONS = 64, 4, 256, 32
# One GPT-2 block: c_attn 3h^2 + 3h, attn c_proj h^2 + h, c_fc 4h^2 + 4h, mlp c_proj 4h^2 + h, two
# layer norms 4h: 12 h^2 + 13 h = 49,984.
BLOCK = 12 * H * H + 13 * H
WTE, WPE, LN_F = VOCAB * H, POSITIONS * H, 2 * H


@pytest.fixture(scope="module")
def profile():
    return gpt2_profile("p", hidden=H, layers=LAYERS, heads=4, vocab=VOCAB, positions=POSITIONS, seq_len=POSITIONS)


def held(profile, stages: int, assignment: str, stage: int) -> int:
    rank = rank_profile(profile, Layout(pipeline=stages, assignment=assignment), stage)
    return rank.held_grad_numel if isinstance(rank, StageProfile) else 0


def test_held_gradients_are_the_largest_virtual_stage(profile):
    assert BLOCK == 49_984
    # Modular, 2 stages: stage 0 runs virtual stages [block 0 + wte + wpe] and [block 2]; stage 1 runs
    # [block 1] and [block 3 + ln_f + the tied head, wte]. looped_bfs holds one virtual stage at a time.
    assert held(profile, 2, "modular", 0) == BLOCK + WTE + WPE == 68_416
    assert held(profile, 2, "modular", 1) == BLOCK + LN_F + WTE == 66_496
    # Contiguous: one virtual stage per rank, the whole stage (two blocks).
    assert held(profile, 2, "contiguous", 0) == 2 * BLOCK + WTE + WPE == 118_400
    assert held(profile, 2, "contiguous", 1) == 2 * BLOCK + LN_F + WTE == 116_480
    # 4 stages of one block: the middle ones hold a block, not the tied embedding.
    assert [held(profile, 4, "modular", s) for s in range(4)] == [BLOCK + WTE + WPE, BLOCK, BLOCK, BLOCK + LN_F + WTE]
    # No pipeline, nothing held: the data-parallel profile is the model's own, a tensor-only rank's holds 0.
    assert rank_profile(profile, Layout(), 0) is profile
    tensor_only = rank_profile(profile, Layout(tensor=2), 0)
    assert isinstance(tensor_only, StageProfile) and tensor_only.held_grad_numel == 0


def test_frozen_parameters_hold_no_gradient(profile):
    frozen = dataclasses.replace(
        profile,
        params=[dataclasses.replace(p, requires_grad=p.name != "transformer.wte.weight") for p in profile.params],
    )
    assert held(frozen, 2, "modular", 0) == BLOCK + WPE
    assert held(frozen, 2, "modular", 1) == BLOCK + LN_F


def test_memory_adds_the_held_gradients_when_a_step_runs_several_micro_batches(profile):
    hardware = example_hardware(gpus_per_node=2)
    model = CostModel(profile, hardware, gpus_per_node=2, dtype="fp32", layout=Layout(pipeline=2))
    assert model.stage == 0  # the critical stage: 2 blocks + wte + wpe against 2 blocks + ln_f + wte
    chunk = 1 << 16
    several = Shape(chunk, 1, 0, 0, 0, 1, 4, layered=True)
    memory = model.memory(several)
    assert memory.transient_bytes["held_grad_bytes"] == (BLOCK + WTE + WPE) * 4
    # The same estimate from a plain profile of the same rank has everything else, and no held term.
    stage = model.profile
    plain = ModelProfile(**{f.name: getattr(stage, f.name) for f in dataclasses.fields(ModelProfile)})
    arguments = dict(
        chunk_size=chunk, world_size=1, gpus_per_node=2, dtype="fp32", cache_blocks=1,
        num_resident=model.layout(chunk).num_resident, num_chunks=model.layout(chunk).num_chunks, num_offloaded=0,
        frozen_numel=0, micro_batch_size=1, every=0, allocator_overhead_bytes=0, activation_copies=4, micro_batches=4,
    )  # fmt: skip
    with_held = estimate_memory(stage, **arguments)
    without = estimate_memory(plain, **arguments)
    assert without.transient_bytes["held_grad_bytes"] == 0
    # and the receive buffers of its 4 micro-batches (stage 0 of 2 modular stages: 3 hidden x seq, bf16)
    assert stage.recv_buffer_bytes_per_sample == 3 * H * POSITIONS * 2
    recv = 4 * stage.recv_buffer_bytes_per_sample * 2  # at fp32, the estimate's dtype
    assert with_held.peak_gpu_bytes - without.peak_gpu_bytes == (BLOCK + WTE + WPE) * 4 + recv
    assert with_held.device_parts()["held gradients (pipeline)"] == (BLOCK + WTE + WPE) * 4
    # One micro-batch per step: every gradient is staged as it arrives.
    assert model.memory(Shape(chunk, 1, 0, 0, 0, 1, 1)).transient_bytes["held_grad_bytes"] == 0
    # Data parallelism only: never.
    data_only = CostModel(profile, hardware, gpus_per_node=2, dtype="fp32", layout=DATA_ONLY)
    assert data_only.memory(several).transient_bytes["held_grad_bytes"] == 0


def test_the_search_prediction_carries_the_held_gradients(profile):
    result = search(
        profile,
        example_hardware(gpus_per_node=2),
        gpus_per_node=2,
        global_batch_size=8,
        fixed=["pipeline=2", "micro_batch_size=2", "dtype=fp32"],
        loop="forward_backward",
    )
    plan = result.plan
    assert plan.training.grad_accum_steps == 4 and plan.training.accumulation == "layered"
    assert plan.prediction is not None
    # The search scored both stages; the plan's model states and transients are those of the stage
    # that needs the most device memory, all of one stage (so that show's parts add up to its peak).
    stages = result.candidates[0].stages
    assert [model.stage for model, _ in stages] == [0, 1]
    largest = max((c.memory for _, c in stages), key=lambda memory: memory.required_gpu_bytes)
    assert plan.prediction.transient_bytes == largest.transient_bytes
    assert plan.prediction.model_state_bytes == largest.model_state_bytes
    assert plan.prediction.peak_gpu_bytes == largest.peak_gpu_bytes
    # Stage 0 holds 2 blocks + wte + wpe unsharded at its peak.
    assert stages[0][1].memory.transient_bytes["held_grad_bytes"] == (BLOCK + WTE + WPE) * 4


def test_receive_buffers_per_micro_batch_and_the_prologue_on_the_first_stage(profile):
    """torch's PipelineStage keeps, per micro-batch, a buffer for the activations each virtual stage
    receives (all but the pipeline's first) and for the gradient of its output (all but the last); the
    activations live before block 0 count on the stage that runs it, and block 0's input leaves the last
    stage's figure (a mask or positions, which every stage builds, stay there too)."""
    boundary = profile.blocks[0].boundary_bytes_per_sample
    assert boundary == H * POSITIONS * 2  # bf16

    def recv(stages: int, assignment: str, stage: int, **layout) -> int:
        rank = rank_profile(profile, Layout(pipeline=stages, assignment=assignment, **layout), stage)
        return rank.recv_buffer_bytes_per_sample if isinstance(rank, StageProfile) else 0

    assert [recv(2, "contiguous", s) for s in (0, 1)] == [boundary, boundary]  # gradients in / activations in
    # Modular: stage 0 runs blocks 0 and 2 (gradients in; activations and gradients in), stage 1 blocks 1 and 3.
    assert [recv(2, "modular", s) for s in (0, 1)] == [3 * boundary, 3 * boundary]
    assert [recv(4, "modular", s) for s in range(4)] == [boundary, 2 * boundary, 2 * boundary, boundary]
    assert recv(2, "contiguous", 0, tensor=2) == boundary // 2  # sequence-parallel hidden states
    assert rank_profile(profile, Layout(tensor=2), 0).recv_buffer_bytes_per_sample == 0

    prologue = 3 * boundary  # what a traced GPT-2 keeps before block 0: the embeddings' sum and its dropout
    traced = dataclasses.replace(profile, prologue_bytes_per_sample=prologue)
    lines = [rank_profile(traced, Layout(pipeline=2, assignment="contiguous"), s).activation for s in (0, 1)]
    before = [rank_profile(profile, Layout(pipeline=2, assignment="contiguous"), s).activation for s in (0, 1)]
    assert lines[0].per_sample_bytes == before[0].per_sample_bytes + prologue
    assert lines[1].per_sample_bytes == before[1].per_sample_bytes - boundary
    # Checkpointed, block 0's input is counted with the blocks' boundaries already: no stage's line moves.
    contiguous = Layout(pipeline=2, assignment="contiguous")
    assert profile.activation_checkpointed is not None
    assert [rank_profile(traced, contiguous, s).activation_checkpointed for s in (0, 1)] == [
        rank_profile(profile, contiguous, s).activation_checkpointed for s in (0, 1)
    ]
    # Without a pipeline the one stage keeps it where it was.
    assert rank_profile(traced, Layout(tensor=2), 0).activation.per_sample_bytes == (
        rank_profile(profile, Layout(tensor=2), 0).activation.per_sample_bytes
    )
