"""Pipeline x tensor in the cost model's held gradients (``stage_profile.held_grad_numel``): under 1d
tensor parallelism the first virtual stage holds the vocabulary-parallel embedding's gradient whole
(torch's sharded embedding computes the whole table's on every tensor rank; the engine reports it so,
tests/distributed/test_engine_mesh3d.py checks the report against what a step held), every other
gradient at this rank's local size."""

from __future__ import annotations

import pytest

from elixir_tune.costmodel.parallel import Layout
from elixir_tune.costmodel.stage_profile import StageProfile, rank_profile
from elixir_tune.costmodel.synthetic import gpt2_profile

H, LAYERS, VOCAB, POSITIONS = 64, 4, 256, 32
WTE, WPE, LN_F = VOCAB * H, POSITIONS * H, 2 * H


@pytest.fixture(scope="module")
def profile():
    return gpt2_profile("p", hidden=H, layers=LAYERS, heads=4, vocab=VOCAB, positions=POSITIONS, seq_len=POSITIONS)


def local_block_numel(rank: StageProfile, block: int) -> int:
    info = next(b for b in rank.blocks if b.index == block)
    return sum(p.numel for p in rank.params[info.first_param : info.first_param + info.num_params])


@pytest.mark.parametrize("tensor", [1, 2])
def test_the_first_virtual_stage_holds_the_embedding_whole_under_tensor_1d(profile, tensor):
    layout = Layout(pipeline=2, tensor=tensor, assignment="modular")
    first, last = rank_profile(profile, layout, 0), rank_profile(profile, layout, 1)
    assert isinstance(first, StageProfile) and isinstance(last, StageProfile)
    block = local_block_numel(first, 0)
    assert block < 12 * H * H + 13 * H or tensor == 1  # the blocks are split
    # Stage 0: [block 0 + wte + wpe] (held) and [block 2]; the embedding whole, the position table replicated.
    assert first.held_grad_numel == block + WTE + WPE
    # Stage 1: [block 1] and [block 3 + ln_f + the tied head]: the head's gradient is this rank's rows.
    assert last.held_grad_numel == local_block_numel(last, 3) + LN_F + WTE // tensor


def test_tensor_2d_holds_the_local_embedding(profile):
    """2d (Optimus) embeddings are split by the engine's own style, not torch's: local size (not measured
    against a step yet: the pipeline x tensor 2d launch is 8 processes)."""
    layout = Layout(pipeline=2, tensor=4, tensor_mode="2d", assignment="modular")
    first = rank_profile(profile, layout, 0)
    assert isinstance(first, StageProfile)
    wte_local = next(p.numel for p in first.params if p.name == "transformer.wte.weight")
    wpe_local = next(p.numel for p in first.params if p.name == "transformer.wpe.weight")
    assert wte_local < WTE
    assert first.held_grad_numel == local_block_numel(first, 0) + wte_local + wpe_local


def test_the_node_host_peak_sums_the_stages_of_its_ranks():
    from elixir_tune.costmodel.memory import node_host_peak_bytes

    per_rank = [10, 30]  # host bytes of one rank of stage 0 and of stage 1
    stage_host = [4 * b for b in per_rank]  # each stage's figure: a node of 4 ranks all of that stage
    # T = 1: rank r is on stage r % 2, so each node of 4 holds two ranks of each stage.
    assert node_host_peak_bytes(stage_host, gpus_per_node=4, nodes=2, tensor=1) == 2 * 10 + 2 * 30
    # T = 4: a node's 4 ranks are one tensor group, all of one stage; the fullest node is stage 1's.
    assert node_host_peak_bytes(stage_host, gpus_per_node=4, nodes=2, tensor=4) == 4 * 30


def test_the_gradient_in_flight_is_the_whole_embedding_under_tensor_1d(profile):
    """Measured: in a tensor-2 step of the tiny Llama the embedding's gradient arrives as a replicated
    DTensor of the whole 128 x 32 table while the rank holds 64 x 32 rows; the device peak's gradients
    in flight (``GRADS_IN_FLIGHT`` x the largest) count it whole, on the stage that runs the embedding."""
    from elixir_tune.costmodel.model import CostModel
    from elixir_tune.costmodel.synthetic import example_hardware

    hardware = example_hardware(gpus_per_node=4)
    tensor2 = CostModel(profile, hardware, 2, layout=Layout(tensor=2))
    assert tensor2.largest_numel == WTE
    assert max(p.numel for p in tensor2.profile.params) < WTE  # every local piece is smaller
    pipeline = Layout(pipeline=2, tensor=2, assignment="modular")
    assert CostModel(profile, hardware, 4, layout=pipeline, stage=0).largest_numel == WTE
    assert CostModel(profile, hardware, 4, layout=pipeline, stage=1).largest_numel < WTE  # the head: local rows
