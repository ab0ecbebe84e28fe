"""Bandwidth between nodes per rank, by the group's share of a node's ranks (costmodel/links.py)."""

from __future__ import annotations

import pytest

from elixir_tune.costmodel.links import data_ranks_per_node, inter_node_bytes_per_s
from elixir_tune.costmodel.model import CostModel
from elixir_tune.costmodel.parallel import Layout
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.costmodel.timeline import transfer_costs
from elixir_tune.hardware import load_hardware

SEQ, HIDDEN = 64, 256


@pytest.fixture(scope="module")
def a100():
    return load_hardware("a100-80gb-sxm")  # inter_node_gbps 180: 8 HDR cards per node


def test_a_group_gets_its_share_of_the_nodes_network(a100):
    node_bps = a100.inter_node_gbps * 1e9
    assert inter_node_bytes_per_s(a100, 8, 8) == pytest.approx(node_bps)
    assert inter_node_bytes_per_s(a100, 8, 2) == pytest.approx(node_bps / 4)
    assert inter_node_bytes_per_s(a100, 8, 1) == pytest.approx(node_bps / 8)  # one card: 22.5 GB/s
    assert inter_node_bytes_per_s(a100, 8, 16) == pytest.approx(node_bps)  # never more than the node


def test_data_group_ranks_per_node():
    assert data_ranks_per_node(8, 1) == 8  # data parallelism only: the whole node
    assert data_ranks_per_node(8, 2) == 4  # tensor 2: every other rank
    assert data_ranks_per_node(8, 8) == 1
    assert data_ranks_per_node(8, 32) == 1  # a replica over 4 nodes: one rank per node


def test_data_collectives_across_nodes_slow_down_with_fewer_group_ranks_per_node(a100):
    chunk, data = 1 << 26, 32
    whole = transfer_costs(a100, chunk, data, 8, 4, "fp16")
    assert transfer_costs(a100, chunk, data, 8, 4, "fp16", 8) == whole  # the default: every rank of the node
    one = transfer_costs(a100, chunk, data, 8, 4, "fp16", 1)
    wire_s = chunk * 2 * (data - 1) / data / (a100.inter_node_gbps * 1e9)
    assert one.allgather_s - whole.allgather_s == pytest.approx(7 * wire_s)
    assert one.reduce_scatter_s - whole.reduce_scatter_s == pytest.approx(7 * wire_s)
    # One node: the node's links, whatever the group.
    assert transfer_costs(a100, chunk, 8, 8, 1, "fp16", 1) == transfer_costs(a100, chunk, 8, 8, 1, "fp16")


def test_cost_model_prices_a_replica_over_nodes_at_one_card_per_rank(a100):
    profile = gpt2_profile("g", hidden=HIDDEN, layers=8, heads=8, vocab=512, positions=SEQ, seq_len=SEQ, dtype="fp16")
    # Pipeline 4 x tensor 4 = 16 ranks per replica on nodes of 8: stages cross nodes, and each data
    # group holds one rank per node.
    model = CostModel(profile, a100, gpus_per_node=8, nodes=4, dtype="fp16", layout=Layout(pipeline=4, tensor=4))
    card_bps = a100.inter_node_gbps * 1e9 / 8
    assert model.parallel_costs.pipeline_bps == pytest.approx(card_bps)
    chunk = 1 << 22
    data = model.data_size
    assert data == 2
    costs = model.costs(chunk)
    expected = transfer_costs(a100, chunk, data, 8, 4, "fp16", 1)
    assert costs == expected
    # Data parallelism only on the same nodes: the whole node's network.
    flat = CostModel(profile, a100, gpus_per_node=8, nodes=4, dtype="fp16")
    assert flat.costs(chunk) == transfer_costs(a100, chunk, flat.data_size, 8, 4, "fp16")
    # A pipeline inside a node keeps the node's links.
    inside = CostModel(profile, a100, gpus_per_node=8, nodes=4, dtype="fp16", layout=Layout(pipeline=2, tensor=4))
    assert inside.parallel_costs.pipeline_bps == pytest.approx(a100.allgather_gbps * 1e9)
