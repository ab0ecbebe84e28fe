"""Expert parallelism in the cost model (costmodel/expert.py and where the step adds it): the
all-to-all bytes and seconds, one rank's expert chunks, their shards and collectives, and the
tensor-parallel traffic of mixture-of-experts blocks."""

from __future__ import annotations

import pytest

from elixir_tune.costmodel.expert import expert_all_to_all_bytes, expert_all_to_all_s, expert_param_indices
from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.costmodel.offload import freed_bytes, offload_cost_s, offload_orders
from elixir_tune.costmodel.parallel import Layout
from elixir_tune.costmodel.parallel_time import TP_MOE_WIRE_FACTOR, ParallelTimes
from elixir_tune.costmodel.timeline import transfer_costs
from elixir_tune.hardware import load_hardware
from elixir_tune.plan.capabilities import EXPERT_PARALLEL_RUNS_WITH
from elixir_tune.plan.memory import pinned_bytes
from elixir_tune.plan.schema import DTYPE_BYTES


def test_no_expert_parallelism_moves_nothing():
    assert expert_all_to_all_bytes(1, 4096, 2048, 8, 48, 2) == 0
    assert expert_all_to_all_s(
        1, 4096, 2048, 8, 2, gpus_per_node=8, intra_node_bps=1, inter_node_bps=1, latency_s=1
    ) == (
        0.0,
        0.0,
    )


def test_bytes_follow_the_rows_that_leave_the_rank():
    # E = 2: half of the 16 x 2 rows leave, 4 all-to-alls per block, 3 blocks, hidden 32, fp32.
    assert expert_all_to_all_bytes(2, 16, 32, 2, 3, 4) == 4 * 3 * (16 * 2 // 2) * 32 * 4
    # A larger group sends a larger share away: (E - 1) / E.
    assert expert_all_to_all_bytes(8, 16, 32, 2, 3, 4) == 4 * 3 * (16 * 2 * 7 // 8) * 32 * 4


def test_seconds_ride_the_node_links_then_the_network():
    rows = 4096 * 2 * 1024 * 2  # tokens x top-k x hidden x bf16 bytes
    links = dict(gpus_per_node=8, intra_node_bps=100e9, inter_node_bps=10e9, latency_s=1e-5)
    # E = 4 on one node: 3/4 of the rows leave the rank on the node's links; 2 all-to-alls and the
    # counts forward, 2 backward.
    one = 1e-5 + rows * 3 / 4 / 100e9
    block_s, forward_s = expert_all_to_all_s(4, 4096, 1024, 2, 2, **links)
    assert forward_s == pytest.approx(2 * one + 1e-5)
    assert block_s == pytest.approx(4 * one + 1e-5)
    # E = 16 over two nodes of 8: 8/16 of the rows go off the node, at a tenth of the bandwidth: that binds.
    one = 1e-5 + rows * 8 / 16 / 10e9
    block_s, _ = expert_all_to_all_s(16, 4096, 1024, 2, 2, **links)
    assert block_s == pytest.approx(4 * one + 1e-5)


@pytest.fixture(scope="module")
def moe():
    from elixir_tune.profiler import profile_model
    from elixir_tune.profiler.source import quiet_transformers
    from tests.zoo.models import SEQ, model_source

    with quiet_transformers():
        return profile_model(model_source("qwen3_moe"), batch_size=2, seq_len=SEQ, checkpointing="all")


@pytest.fixture(scope="module")
def h100():
    return load_hardware("h100-80gb-sxm")


def test_the_profile_names_its_expert_tensors(moe):
    names = [moe.params[i].name for i in expert_param_indices(moe)]
    assert sorted(names) == [f"model.layers.{b}.mlp.experts.{p}" for b in (0, 1) for p in ("down_proj", "gate_up_proj")]
    assert all(moe.params[i].shape[0] == 4 for i in expert_param_indices(moe))


def test_a_rank_holds_its_experts_in_chunks_of_their_own(moe, h100, monkeypatch):
    plain = CostModel(moe, h100, gpus_per_node=4)
    model = CostModel(moe, h100, gpus_per_node=4, layout=Layout(expert=2))
    assert model.data_size == 4 and model.experts.replicas == 2  # expert parallelism adds no ranks
    by_name = {p.name: p for p in model.profile.params}
    for param in plain.profile.params:
        expected = [param.shape[0] // 2, *param.shape[1:]] if ".experts." in param.name else param.shape
        assert by_name[param.name].shape == expected, param.name
    chunk_size = 1 << 16
    layout = model.layout(chunk_size)
    experts = {model.profile.params[i].name for i in model.experts.params}
    assert layout.num_expert >= 1
    for chunk in layout.chunks:
        names = {model.profile.params[i].name for i in chunk.params}
        assert names <= experts if chunk.expert else not names & experts
    # An expert chunk's shard is E data shards; it is offloaded only where the engine's limits table allows.
    assert model.experts.shard_units(layout) == layout.num_chunks + layout.num_expert
    for offloadable in (False, True):
        monkeypatch.setitem(EXPERT_PARALLEL_RUNS_WITH, "offloaded_experts", offloadable)
        model._orders.clear()
        order = model.offload_order(chunk_size, 0, model.min_cache_blocks(chunk_size, 0))
        assert sorted(order) == [c for c, chunk in enumerate(layout.chunks) if offloadable or not chunk.expert]
        expected = layout.num_chunks - (0 if offloadable else layout.num_expert)
        assert model.offloadable_chunks(chunk_size) == expected
    shape = Shape(chunk_size, layout.num_cacheable, 0, 0, 0, 2, 2)
    shard_bytes = model.memory(shape).model_state_bytes["device_shard_bytes"]
    assert shard_bytes == model.experts.shard_units(layout) * (chunk_size // 4) * 16  # fp32 master, grad, Adam m, v


def test_expert_chunks_reduce_over_the_expert_data_group(moe, h100):
    chunk_size = 1 << 16
    half = CostModel(moe, h100, gpus_per_node=4, layout=Layout(expert=2))
    whole = CostModel(moe, h100, gpus_per_node=4, layout=Layout(expert=4))
    dtype = half.dtype
    expected = transfer_costs(h100, chunk_size, 2, 4, 1, dtype)
    assert half.expert_costs(chunk_size) and all(c == expected for c in half.expert_costs(chunk_size).values())
    # E = D: every rank holds its experts alone, no collective: a cast and an addition.
    alone = transfer_costs(h100, chunk_size, 1, 4, 1, dtype)
    assert all(c == alone for c in whole.expert_costs(chunk_size).values())
    assert alone.allgather_s < expected.allgather_s < half.costs(chunk_size).allgather_s


@pytest.mark.parametrize("every", [0, 1])
def test_the_step_adds_the_all_to_alls_on_the_compute_stream(moe, h100, every):
    model = CostModel(moe, h100, gpus_per_node=4, layout=Layout(expert=2))
    plain = CostModel(moe, h100, gpus_per_node=4)
    chunk_size = 1 << 16
    shape = Shape(chunk_size, model.layout(chunk_size).num_cacheable, 0, 0, every, 2, 3)
    block_s, forward_s = expert_all_to_all_s(
        2,
        2 * moe.seq_len,
        moe.arch.hidden_size,
        2,
        DTYPE_BYTES[model.dtype],
        gpus_per_node=4,
        intra_node_bps=h100.allgather_gbps * 1e9,
        inter_node_bps=h100.inter_node_gbps * 1e9,
        latency_s=h100.collective_latency_s,
    )
    per_micro_batch = 2 * block_s + (2 * forward_s if every else 0.0)  # 2 MoE blocks, both checkpointed
    estimate = model.step_time(shape)
    assert estimate.breakdown["expert_comm_s"] == pytest.approx(3 * per_micro_batch)
    # The same compute as without expert parallelism, the exchanges on top of it (nothing overlaps them).
    assert model.compute_s(2, every)[0] == pytest.approx(plain.compute_s(2, every)[0] + per_micro_batch)
    assert "expert_comm_s" not in plain.step_time(shape).breakdown


def test_tensor_parallel_moe_blocks_move_more_than_dense_ones(moe, h100):
    costs = ParallelTimes(moe, h100, 2, Layout(tensor=2), 0, "fp32")
    assert costs.tensor_moe_blocks == {0, 1}
    tokens = 2 * moe.seq_len
    # One dense layer's 1D bytes: 8 collectives of tokens x hidden, half through each of 2 ranks.
    wire_s = 8 * tokens * moe.arch.hidden_size * 4 / 2 / (h100.allgather_gbps * 1e9)
    dense = costs.tensor_comm_s(2, 2, 0)
    # 10/8 of the bytes, and one more collective backward (the routing weights' gradient).
    moe_extra_s = 2 * wire_s * (TP_MOE_WIRE_FACTOR - 1) + 2 * h100.collective_latency_s
    assert costs.tensor_comm_s(2, 2, 0, moe_blocks=2) == pytest.approx(dense + moe_extra_s)
    # The cost model counts the profile's MoE blocks.
    model = CostModel(moe, h100, gpus_per_node=2, dtype="fp32", layout=Layout(tensor=2))
    assert model.tensor_comm_s(2, 0) == pytest.approx(dense + moe_extra_s)


def test_an_offloaded_expert_chunk_moves_e_data_shards_to_the_host(moe, h100):
    """An expert chunk's shard (over the D / E ranks of its expert-data group) is E data-group shards:
    offloading it moves E shards' master, gradient and Adam moments to the host, E shards' upload copy
    and (cuda) a landing buffer of E shards of its own, and its copies and host Adam count E shards' elements in the step's bounds and in the offload
    order."""
    model = CostModel(moe, h100, gpus_per_node=4, dtype="bf16", layout=Layout(expert=2))
    chunk_size = 1 << 16
    layout = model.layout(chunk_size)
    expert = next(c for c, chunk in enumerate(layout.chunks) if chunk.expert)
    dense = next(c for c, chunk in enumerate(layout.chunks) if not chunk.expert and not chunk.resident)
    shard_numel, item = chunk_size // model.data_size, DTYPE_BYTES[model.dtype]
    units = model.experts.shard_units(layout)

    def shape(offloaded: int) -> Shape:
        return Shape(chunk_size, layout.num_cacheable, 1, 0, 0, 2, 2, offloaded=(offloaded,))

    for chunk, shards in ((dense, 1), (expert, 2)):
        memory = model.memory(shape(chunk))
        states = memory.model_state_bytes
        assert states["host_shard_bytes"] == shards * shard_numel * 16, chunk  # fp32 master, grad, Adam m, v
        assert states["device_shard_bytes"] == (units - shards) * shard_numel * 16, chunk
        assert memory.transient_bytes["host_copy_bytes"] == pinned_bytes(shards * shard_numel * item, True), chunk
        # The staging pool's landing shards, and on cuda an expert chunk's own (its shard is E of the pool's).
        pool = pinned_bytes(shape(chunk).staging_buffers * shard_numel * item, True)
        own = pinned_bytes(shards * shard_numel * item, True) if chunk == expert else 0
        assert memory.transient_bytes["landing_bytes"] == pool + own, chunk
        bounds = model.step_time(shape(chunk)).breakdown
        assert bounds["bound_cpu_adam_s"] == pytest.approx(
            shards
            * shard_numel
            * 4
            / (h100.cpu_adam_node_elems_per_s or h100.cpu_adam_elems_per_s * h100.gpus_per_node)
        ), chunk
    # The offload order weighs the expert chunk's seconds against the E shards' bytes it frees.
    costs, expert_costs = model.costs(chunk_size), model.expert_costs(chunk_size)
    weights = model.experts.shard_weights(layout)
    assert weights[expert] == 2 and weights[dense] == 1
    freed = freed_bytes(layout, shard_numel, model.dtype, weights)
    assert freed[expert] == 2 * freed[dense] == 2 * shard_numel * 16
    fetches = [1] * layout.num_chunks
    order = offload_orders(layout, fetches, 2, shard_numel, model.dtype, costs, 1e-9, expert_costs, weights)[0]
    per_byte = {
        c: offload_cost_s(False, 1, 2, weights[c] * shard_numel, expert_costs.get(c, costs), 1e-9) / freed[c]
        for c in range(layout.num_chunks)
    }
    assert [per_byte[c] for c in order] == sorted(per_byte.values())
