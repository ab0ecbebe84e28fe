"""Worker for test_engine_comm.py: every collective of engine/comm/, native and gloo-fallback paths."""

from __future__ import annotations

import json
import sys

import torch

from elixir_tune.engine.comm import init_comm


def main() -> None:
    comm = init_comm(int(__import__("os").environ["WORLD_SIZE"]), "cpu", "gloo")
    rank, world = comm.rank, comm.world_size
    checks = {}
    for native in (None, False):  # None: try the native collective; False: force the fallback
        comm._native_gather = comm._native_scatter = native
        shard = torch.arange(3, dtype=torch.float32) + 10 * rank
        full = torch.empty(3 * world)
        comm.all_gather_into_tensor(full, shard, async_op=True).wait()
        expected = torch.cat([torch.arange(3, dtype=torch.float32) + 10 * r for r in range(world)])
        checks[f"gather_{native}"] = torch.equal(full, expected)
        grads = torch.arange(2.0 * world) * (rank + 1)
        out = torch.empty(2)
        handle = comm.reduce_scatter_tensor(out, grads, async_op=True)
        handle.wait()
        handle.wait()  # idempotent
        total = sum(r + 1 for r in range(world))
        checks[f"scatter_{native}"] = torch.equal(out, torch.arange(2.0 * world)[2 * rank : 2 * rank + 2] * total)
    value = torch.tensor([float(rank)])
    comm.all_reduce_sum(value)
    checks["sum"] = float(value) == sum(range(world))
    value = torch.tensor([float(rank)])
    comm.all_reduce_max(value)
    checks["max"] = float(value) == world - 1
    value = torch.tensor([float(rank + 5)])
    comm.broadcast(value, src=0)
    checks["broadcast"] = float(value) == 5.0
    comm.barrier()
    with open(f"{sys.argv[2]}.rank{rank}.json", "w") as f:
        json.dump([checks], f)


if __name__ == "__main__":
    main()
