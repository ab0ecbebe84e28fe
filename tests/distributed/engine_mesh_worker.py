"""Worker for test_engine_mesh.py: the mesh's groups follow the documented rank layout."""

from __future__ import annotations

import json
import os
import sys

import torch

from elixir_tune.engine.comm import init_mesh


def main() -> None:
    with open(sys.argv[1]) as f:
        (case,) = json.load(f)
    pipeline, tensor = case["pipeline"], case["tensor"]
    world = int(os.environ["WORLD_SIZE"])
    mesh = init_mesh(world, "cpu", "gloo", pipeline=pipeline, tensor=tensor)
    rank = mesh.world.rank
    # rank = (data_index * P + stage) * T + tensor_index
    expected = ((mesh.data_rank * pipeline + mesh.stage) * tensor) + mesh.tensor_rank
    sums = {}
    for name in ("data", "pipeline", "tensor"):
        comm = getattr(mesh, name)
        value = torch.tensor([float(rank)])
        comm.all_reduce_sum(value)
        sums[name] = [float(value), sum(comm.global_ranks), comm.world_size]
        first = torch.tensor([float(rank)])
        comm.broadcast(first, src=0)
        sums[name].append(float(first) == comm.global_ranks[0])
    report = {
        "layout": expected == rank,
        "sizes": [mesh.data.world_size, mesh.pipeline.world_size, mesh.tensor.world_size],
        "sums": sums,
        "device_mesh": mesh.device_mesh is not None and list(mesh.device_mesh.mesh_dim_names),
    }
    with open(f"{sys.argv[2]}.rank{rank}.json", "w") as f:
        json.dump([report], f)


if __name__ == "__main__":
    main()
