"""Worker for test_engine_mesh.py: the mesh's groups follow the documented rank layout.

Each case is ``{"pipeline": P, "tensor": T}``; one launch runs every case, each on a mesh of its own.
"""

from __future__ import annotations

import torch

from elixir_tune.engine.comm import init_mesh


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    pipeline, tensor = case["pipeline"], case["tensor"]
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
    return {
        "case": case,
        "layout": expected == rank,
        "sizes": [mesh.data.world_size, mesh.pipeline.world_size, mesh.tensor.world_size],
        "sums": sums,
        "device_mesh": mesh.device_mesh is not None and list(mesh.device_mesh.mesh_dim_names),
    }


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
