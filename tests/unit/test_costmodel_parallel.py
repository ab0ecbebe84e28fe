"""Pipeline and tensor parallelism in the cost model: the formulas against numbers worked by hand,
and one rank's view of a profile (costmodel/parallel.py, costmodel/stage_profile.py,
costmodel/parallel_time.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.costmodel.parallel import (
    Layout,
    bubble_fraction,
    data_degree,
    layer_matmuls,
    p2p_sends_per_micro_batch,
    tensor_degrees,
    tp_1d_layer_bytes,
    tp_2d_layer_elements,
    tp_activation_factor,
    tp_boundary_factor,
    tp_efficiency,
    virtual_stages,
)
from elixir_tune.costmodel.stage_profile import critical_stage, rank_profile
from elixir_tune.costmodel.synthetic import example_hardware, gpt2_profile
from elixir_tune.costmodel.timeline import transfer_costs

HIDDEN, LAYERS, HEADS, VOCAB, SEQ = 64, 4, 4, 256, 32


@pytest.fixture(scope="module")
def profile():
    return gpt2_profile("p", hidden=HIDDEN, layers=LAYERS, heads=HEADS, vocab=VOCAB, positions=SEQ, seq_len=SEQ)


def test_data_degree_is_world_over_pipeline_times_tensor():
    assert data_degree(16, 2, 4) == 2
    assert Layout(pipeline=2, tensor=2).data_degree(8) == 2
    with pytest.raises(ValueError, match="does not divide the world size 12"):
        data_degree(12, 8, 1)


def test_bubble_of_looped_bfs():
    # (P - 1) / (N v + P - 1): 4 stages, 8 micro-batches, 24 blocks modular -> v = 6: 3 / 51.
    assert virtual_stages(24, 4, "modular") == 6
    assert bubble_fraction(4, 8, virtual_stages(24, 4, "modular")) == pytest.approx(3 / 51)
    # contiguous: v = 1 (GPipe): 3 / 11
    assert bubble_fraction(4, 8, virtual_stages(24, 4, "contiguous")) == pytest.approx(3 / 11)
    assert bubble_fraction(1, 8, 1.0) == 0.0
    # fewer micro-batches than stages: each loop over the stages waits for the first micro-batch to come
    # back (P slots for N of work): 2 stages, 40 virtual stages each, 1 micro-batch: 40 of 41 + 40 slots
    assert bubble_fraction(2, 1, 40) == pytest.approx(1 - 40 / (39 * 2 + 1 + 1))
    assert bubble_fraction(2, 1, 1) == pytest.approx(1 / 2)  # GPipe, one micro-batch: half idle


def test_p2p_sends_and_bytes(profile):
    # 4 blocks over 2 stages, modular: boundaries 0|1, 1|2, 2|3 all cross -> 3 sends / 2 ranks.
    assert p2p_sends_per_micro_batch(4, 2, "modular") == 1.5
    assert p2p_sends_per_micro_batch(4, 2, "contiguous") == 0.5
    hardware = example_hardware(gpus_per_node=4)
    model = CostModel(profile, hardware, gpus_per_node=4, layout=Layout(pipeline=2))
    costs = model.parallel_costs
    # A block's input: seq x hidden x 2 bytes (the synthetic profile's boundary), no tensor split.
    assert costs.send_bytes_per_sample == SEQ * HIDDEN * 2
    compute_s = 1.0  # large: the sends hide behind it, only the fill and drain hops show
    extra = costs.pipeline_s(compute_s, micro_batch_size=2, micro_batches=4)
    send_s = hardware.collective_latency_s + 2 * SEQ * HIDDEN * 2 / (hardware.allgather_gbps * 1e9)
    assert extra["p2p_s"] == pytest.approx(2 * (2 - 1) * send_s)
    assert extra["pipeline_bubble_s"] == pytest.approx(compute_s * (1 / (4 * 2 + 1)) / (1 - 1 / (4 * 2 + 1)))
    # The tied wte (vocab x hidden, bf16) is all-reduced between the first and the last stage.
    assert extra["tied_allreduce_s"] == pytest.approx(
        hardware.collective_latency_s + VOCAB * HIDDEN * 2 / (hardware.allgather_gbps * 1e9)
    )
    # Sequence-parallel TP 2 halves what a stage sends.
    both = CostModel(profile, hardware, gpus_per_node=4, layout=Layout(pipeline=2, tensor=2))
    assert both.parallel_costs.send_bytes_per_sample == SEQ * HIDDEN


def test_tensor_1d_bytes_per_layer():
    # 8 collectives (2 AG + 2 RS forward, the same backward) of b s h elements, (T-1)/T each:
    # 8 x (2 x 1024 x 4096) x 2 bytes x 3/4 = 100,663,296.
    assert tp_1d_layer_bytes(2 * 1024, 4096, 4, 2) == 100_663_296
    assert tp_1d_layer_bytes(2048, 4096, 1, 2) == 0


def test_tensor_2d_elements_per_layer():
    # h = 4, MLP 16, 4 heads of which 4 kv: q/k/v (4 x 12), out (4 x 4), up (4 x 16), down (16 x 4).
    matmuls = layer_matmuls(4, 16, 4, 4, gated=False)
    assert matmuls == [(4, 12), (4, 4), (4, 16), (16, 4)]
    # m = 8 tokens, q = 2: forward (1/4) x [(32+48) + (32+16) + (32+64) + (128+64)] = 104; x3 with backward.
    assert tp_2d_layer_elements(8, matmuls, 2) == pytest.approx(312)
    # Grouped-query attention: 8 heads, 2 kv heads -> k and v are a quarter wide; gated MLP: two up matmuls.
    assert layer_matmuls(8, 16, 8, 2, gated=True) == [(8, 12), (8, 8), (8, 16), (8, 16), (16, 8)]


def test_activation_factors():
    assert tp_activation_factor("1d", 4, sequence_parallel=True) == 0.25
    assert tp_activation_factor("1d", 4, sequence_parallel=False) == pytest.approx((10 + 24 / 4) / 34)
    assert tp_activation_factor("2d", 4, sequence_parallel=False) == 0.25
    assert tp_boundary_factor("1d", 4, sequence_parallel=False) == 1.0
    assert tp_boundary_factor("2d", 4, sequence_parallel=False) == 0.25
    # Narrower matrices run slower without a measured curve: h / T = 1024 of 4096 columns.
    assert tp_efficiency(4096, 4, "1d") == pytest.approx((1024 / 1152) / (4096 / 4224))
    assert tp_efficiency(4096, 4, "2d") == pytest.approx((2048 / 2176) / (4096 / 4224))


def test_rank_profile_holds_its_stage_at_local_shapes(profile):
    layout = Layout(pipeline=2, tensor=2)
    first, last = rank_profile(profile, layout, 0), rank_profile(profile, layout, 1)
    assert [b.index for b in first.blocks] == [0, 2] and [b.index for b in last.blocks] == [1, 3]
    names = {p.name: p for p in first.params}
    assert "transformer.wpe.weight" in names and "transformer.h.1.ln_1.weight" not in names
    # Conv1D c_attn [h, 3h] column-parallel: [64, 96]; the tied wte [V/2, h], held by both ends.
    assert names["transformer.h.0.attn.c_attn.weight"].shape == [HIDDEN, 3 * HIDDEN // 2]
    assert names["transformer.wte.weight"].numel == VOCAB // 2 * HIDDEN
    assert {p.name for p in last.params} >= {"transformer.wte.weight", "transformer.ln_f.weight"}
    # FLOPs: the stage's blocks (and the head on the last stage), halved by the tensor split.
    block_fwd = profile.blocks[0].fwd_flops_per_sample
    head = profile.flops_per_sample - 3 * LAYERS * block_fwd
    assert first.flops_per_sample == pytest.approx(3 * 2 * block_fwd / 2)
    assert last.flops_per_sample == pytest.approx((3 * 2 * block_fwd + head) / 2)
    # Activations: half of the blocks' share, halved again by sequence parallelism; the logits, whole
    # (the engine gathers them before the loss), on the last.
    blocks_act = LAYERS * profile.blocks[0].activation_bytes_per_sample
    assert first.activation.per_sample_bytes == int(blocks_act / 2 / 2)
    logits = profile.activation.per_sample_bytes - blocks_act
    assert last.activation.per_sample_bytes == int(blocks_act / 2 / 2 + logits)
    # Every trace step touches only the stage's parameters.
    assert all(0 <= i < len(first.params) for step in first.trace for i in step)
    assert critical_stage(profile, Layout(pipeline=2)) in (0, 1)


def test_cost_model_shards_over_the_data_degree(profile):
    hardware = example_hardware(gpus_per_node=8)
    model = CostModel(profile, hardware, gpus_per_node=8, layout=Layout(pipeline=2, tensor=2))
    assert model.data_size == 2 and model.world_size == 8
    chunk = 1 << 16
    assert model.costs(chunk) == transfer_costs(hardware, chunk, 2, 8, 1, model.dtype)
    # Model states: this rank's shard is chunk / data degree, not / world.
    shape_states = model.memory(Shape(chunk, 1, 0, 0, 0, 1, 1)).model_state_bytes
    assert shape_states["device_shard_bytes"] == model.layout(chunk).num_chunks * (chunk // 2) * 16


def test_tensor_degrees_follow_node_and_heads(profile):
    # 4 heads on an 8-GPU node: T in 2, 4 (1d), and 4 as a 2 x 2 grid; 8 does not divide the heads.
    assert tensor_degrees(profile, 8) == [(1, "1d"), (2, "1d"), (4, "1d"), (4, "2d")]
    assert tensor_degrees(profile, 2) == [(1, "1d"), (2, "1d")]


def test_tensor_degrees_offer_2d_only_where_the_table_has_a_grid_form(profile):
    # A mixture's experts have no 2D form (plan/tensor_layout.py grid_problem): 1d only, from the same table.
    moe_table = {"transformer.h.*.mlp.experts": "experts", "transformer.h.*.mlp.experts.gate_up": "packed_colwise"}
    moe = dataclasses.replace(profile, arch=dataclasses.replace(profile.arch, tensor_layout=moe_table))
    assert tensor_degrees(moe, 8) == [(1, "1d"), (2, "1d"), (4, "1d")]


def test_tensor_collectives_are_on_the_step(profile):
    hardware = example_hardware(gpus_per_node=2)
    plain = CostModel(profile, hardware, gpus_per_node=2)
    tensor = CostModel(profile, hardware, gpus_per_node=2, layout=Layout(tensor=2))
    layer_s, forward_share = tensor.parallel_costs.tensor_layer_s(micro_batch_size=1)
    expected = 8 * hardware.collective_latency_s + tp_1d_layer_bytes(SEQ, HIDDEN, 2, 2) / (
        hardware.allgather_gbps * 1e9
    )
    assert layer_s == pytest.approx(expected) and forward_share == 0.5
    # Sequence parallelism: each norm parameter (ln_1, ln_2 weight and bias per block, ln_f's two) and
    # each row-parallel bias (attn.c_proj, mlp.c_proj per block) has a partial gradient, all-reduced
    # once per micro-batch: 2 (T-1)/T of its bf16 bytes on the wire.
    norms_s = (6 * LAYERS + 2) * (hardware.collective_latency_s + HIDDEN * 2 * 1.0 / (hardware.allgather_gbps * 1e9))
    edges_s = 4 * tensor.parallel_costs.latency_s + 4 * SEQ * HIDDEN * 2 / 2 / (hardware.allgather_gbps * 1e9)
    # and the head's vocabulary-split logits gathered whole before the loss (seq x vocab, bf16, half of it in)
    edges_s += tensor.parallel_costs.latency_s + SEQ * VOCAB * 2 / 2 / (hardware.allgather_gbps * 1e9)
    assert tensor.tensor_comm_s(1, 0) == pytest.approx(LAYERS * layer_s + edges_s + norms_s)
    no_sp = CostModel(profile, hardware, gpus_per_node=2, layout=Layout(tensor=2, sequence_parallel=False))
    no_sp_layer_s = no_sp.parallel_costs.tensor_layer_s(micro_batch_size=1)[0]
    assert no_sp.tensor_comm_s(1, 0) == pytest.approx(LAYERS * no_sp_layer_s + edges_s)  # norms on whole tokens
    # Checkpointed blocks gather again in their recomputed forward.
    assert tensor.tensor_comm_s(1, 1) == pytest.approx(tensor.tensor_comm_s(1, 0) + LAYERS * layer_s / 2)
    assert plain.tensor_comm_s(1, 1) == 0.0
    assert math.isclose(plain.parallel_costs.rate_factor, 1.0)


def test_an_uneven_modular_split_puts_the_head_with_the_last_block():
    # 3 blocks on 2 stages: blocks 0 and 2 on stage 0, so the final norm, the head, the loss and the
    # tied embedding all live on stage 0 (the engine's placement); stage 1 holds block 1 only.
    from elixir_tune.costmodel.stage_profile import tied_params

    three = gpt2_profile("p3", hidden=HIDDEN, layers=3, heads=HEADS, vocab=VOCAB, positions=SEQ, seq_len=SEQ)
    layout = Layout(pipeline=2)
    stage0, stage1 = rank_profile(three, layout, 0), rank_profile(three, layout, 1)
    assert [b.index for b in stage0.blocks] == [0, 2] and [b.index for b in stage1.blocks] == [1]
    assert {"transformer.ln_f.weight", "transformer.wte.weight"} <= {p.name for p in stage0.params}
    assert not {"transformer.ln_f.weight", "transformer.wte.weight"} & {p.name for p in stage1.params}
    block_fwd = three.blocks[0].fwd_flops_per_sample
    head = three.flops_per_sample - 3 * 3 * block_fwd
    assert stage0.flops_per_sample == pytest.approx(3 * 2 * block_fwd + head)
    assert stage1.flops_per_sample == pytest.approx(3 * block_fwd)
    assert tied_params(three, layout) == []  # both users of the tied embedding on one stage


def test_pipeline_by_tensor_prices_each_stage_at_tensor_width_over_the_data_group(profile):
    """pp2 x tp2 at world 8: a rank runs half the blocks at half width (its FLOPs about a quarter of the
    model's), pays the tensor collectives of its own blocks only, and shards its chunks over D = 2."""
    hardware = example_hardware(gpus_per_node=8)
    both = CostModel(profile, hardware, gpus_per_node=8, layout=Layout(pipeline=2, tensor=2))
    tensor = CostModel(profile, hardware, gpus_per_node=8, layout=Layout(tensor=2))
    pipeline = CostModel(profile, hardware, gpus_per_node=8, layout=Layout(pipeline=2))
    assert (both.data_size, tensor.data_size, pipeline.data_size) == (2, 4, 4)
    assert len(both.profile.blocks) == len(pipeline.profile.blocks) == LAYERS // 2
    assert both.profile.flops_per_sample == pytest.approx(pipeline.profile.flops_per_sample / 2, rel=0.05)
    # The tensor collectives of the stage's 2 blocks (the head's and embedding's at the edges): less than tp2's 4.
    layer_s, _ = both.parallel_costs.tensor_layer_s(2)
    assert layer_s == tensor.parallel_costs.tensor_layer_s(2)[0] > 0
    assert 2 * layer_s < both.tensor_comm_s(2, every=0) < tensor.tensor_comm_s(2, every=0)
    # Sends are the sequence shards (1/T), and the rank belongs to three groups of more than one rank.
    assert both.parallel_costs.send_bytes_per_sample == pipeline.parallel_costs.send_bytes_per_sample / 2
    assert both.parallel_costs.communicators(both.data_size) == 3
    extra = both.parallel_costs.pipeline_s(1.0, micro_batch_size=2, micro_batches=4)
    assert extra["pipeline_bubble_s"] > 0 and extra["p2p_s"] > 0
