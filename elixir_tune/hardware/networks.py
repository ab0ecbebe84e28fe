"""Inter-node link presets: what a node's network carries, so that its effect is one flag (``--network``).

A preset replaces the hardware's ``inter_node_gbps``: the bus bandwidth of a collective spanning
nodes with every rank of each node in it, for the whole node (``costmodel/links.py`` gives a group
with fewer ranks per node its share). Each figure is the line rate of the node's cards times 0.9,
the share of the line rate NCCL reaches that the hardware presets assume for InfiniBand
(configs/hardware/a100-80gb-sxm.yaml, h100-80gb-sxm.yaml: an estimate, not a measurement).

* ``ib-hdr``: 8 x 200 Gb/s HDR InfiniBand, one card per GPU (DGX A100 datasheet);
* ``ib-ndr``: 8 x 400 Gb/s NDR InfiniBand, one card per GPU (DGX H100 datasheet);
* ``eth-100`` / ``eth-25``: one 100 or 25 Gb/s Ethernet card for the whole node, the commodity
  cluster of Lamy-Poirier 2021 (arXiv 2106.02679), whose methods claim to make a fast InfiniBand
  network unnecessary.

Only the bandwidth changes: the collective latency stays the hardware's (an Ethernet network's is
larger; no sourced figure was found, so a latency-bound step is predicted optimistically there).
This module imports no torch.
"""

from __future__ import annotations

import dataclasses

from elixir_tune.hardware.spec import HardwareSpec

# Share of the line rate a collective reaches: the 0.9 the InfiniBand presets use (an estimate).
LINK_EFFICIENCY = 0.9
# Gb/s of line rate per node (cards x rate): see the module docstring for each source.
NETWORK_LINE_GBITS = {
    "ib-hdr": 8 * 200.0,
    "ib-ndr": 8 * 400.0,
    "eth-100": 100.0,
    "eth-25": 25.0,
}
NETWORK_WORDS = {
    "ib-hdr": "8 x 200 Gb/s HDR InfiniBand per node",
    "ib-ndr": "8 x 400 Gb/s NDR InfiniBand per node",
    "eth-100": "one 100 Gb/s Ethernet card per node",
    "eth-25": "one 25 Gb/s Ethernet card per node",
}
NETWORKS = tuple(NETWORK_LINE_GBITS)


def network_gbps(name: str) -> float:
    """The node's inter-node bus bandwidth (GB/s) under a preset.

    Raises:
        ValueError: an unknown preset (names the known ones).
    """
    if name not in NETWORK_LINE_GBITS:
        raise ValueError(f"--network {name}: unknown (known: {', '.join(NETWORKS)})")
    return NETWORK_LINE_GBITS[name] / 8.0 * LINK_EFFICIENCY


def with_network(hardware: HardwareSpec, name: str | None) -> HardwareSpec:
    """The hardware with a preset's inter-node bandwidth (unchanged for None).

    Args:
        hardware: the node spec.
        name: a key of ``NETWORK_LINE_GBITS``, or None for the hardware's own figure.

    Returns:
        A copy whose ``inter_node_gbps`` and its source are the preset's.

    Raises:
        ValueError: an unknown preset.
    """
    if name is None:
        return hardware
    gbps = network_gbps(name)
    sources = {**hardware.sources, "inter_node_gbps": f"--network {name}: {NETWORK_WORDS[name]} x {LINK_EFFICIENCY}"}
    return dataclasses.replace(hardware, inter_node_gbps=gbps, sources=sources)
