"""Bandwidth between nodes for one rank, by how many of a node's ranks share the group.

A preset's ``inter_node_gbps`` is the bus bandwidth of a collective that spans nodes with every
rank of each node in it: NCCL then runs one ring (or tree) per network card, so the node's cards
all carry the group's traffic (a DGX A100: 8 HDR cards, 8 x 25 GB/s x 0.9 = 180 GB/s). A group with
fewer ranks on each node reaches fewer cards, and the node's other ranks are busy with their own
groups at the same time (data parallelism beside pipeline or tensor parallelism: every data group
holds one rank of each P x T block of consecutive ranks; a pipeline stage sends to the next stage's
rank on another node while the node's other ranks do the same). So a group with k of a node's G
ranks gets k / G of the node's bandwidth: a send between two ranks on different nodes, or a data
group with one rank per node, moves at one card's share, 1/8 of the figure on a DGX.
"""

from __future__ import annotations

from elixir_tune.hardware.spec import HardwareSpec


def data_ranks_per_node(gpus_per_node: int, model_parallel: int) -> int:
    """Ranks of one data-parallel group on a node: ranks are numbered with the P x T ranks of one
    model replica consecutive, so a node holds G / (P x T) of each data group (at least 1)."""
    return max(1, gpus_per_node // max(1, model_parallel))


def inter_node_bytes_per_s(hardware: HardwareSpec, gpus_per_node: int, group_ranks_per_node: int) -> float:
    """Bytes/s per rank of a collective or a send between nodes whose group holds
    ``group_ranks_per_node`` of the node's ``gpus_per_node`` ranks.

    Args:
        hardware: the node spec (``inter_node_gbps``: the whole node's bus bandwidth).
        gpus_per_node: G, ranks per node.
        group_ranks_per_node: k, the group's ranks on one node (1 for a point-to-point send).

    Returns:
        ``inter_node_gbps`` x min(k, G) / G, in bytes/s.
    """
    ranks = max(1, gpus_per_node)
    return hardware.inter_node_gbps * 1e9 * min(max(1, group_ranks_per_node), ranks) / ranks


def context_link_bytes_per_s(hardware: HardwareSpec, gpus_per_node: int, degree: int, tensor: int, mode: str) -> float:
    """Bytes/s per rank of a context group's exchange (``costmodel/context.py``, Links).

    The group is C ranks T apart, so it holds k = G / T of a node's ranks when C x T > G. On one node
    every mode moves at ``allgather_gbps``. Across nodes: an all-gather is a collective with k ranks
    per node (``inter_node_bytes_per_s``); a ring advances at its slowest hop, a send between nodes
    over one card; an all-to-all sends (C - k) / C of its bytes off the node through the rank's own
    card (all-to-all cannot aggregate a node's cards: NVIDIA/nccl-tests#267) and (k - 1) / C on the
    node at the same time, the slower of the two setting the pace.

    Args:
        hardware: the node spec.
        gpus_per_node: G.
        degree: context degree C.
        tensor: tensor degree T (the group's ranks are T apart).
        mode: ``ulysses``, ``allgather`` or ``ring``.

    Returns:
        The rate at which the (C - 1) / C of a rank's bytes that leave it move.
    """
    intra = hardware.allgather_gbps * 1e9
    on_node = max(1, gpus_per_node // max(1, tensor))
    if degree <= on_node:
        return intra
    if mode == "allgather":
        return inter_node_bytes_per_s(hardware, gpus_per_node, on_node)
    one_card = inter_node_bytes_per_s(hardware, gpus_per_node, 1)
    if mode == "ring":
        return one_card
    slowest_s = max((on_node - 1) / intra, (degree - on_node) / one_card)
    return (degree - 1) / slowest_s
