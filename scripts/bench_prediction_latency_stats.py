#!/usr/bin/env python
"""The probe's loaded collective latency by two statistics on the same samples, repeated: how steady is each?

    .venv/bin/python scripts/bench_prediction_latency_stats.py --repeats 8 --pairs 50

Two gloo processes, one thread each, bound to a core each where the machine has 2 (as the probe's workers),
take ``--pairs`` pairs per repeat as ``hardware/workers._loaded_latency_s`` does: a GPT-2 block of the
probe's first shape (8 x 128, hidden 64) alone, then the block and a 1 KiB all-gather. Each repeat
gives the latency by the old statistic (per rank the median with the all-gather less the median
without, the largest rank's) and by the probe's (per rank the median of the pairs' differences,
``timing.median_paired_extra_s``, the largest rank's). Prints every repeat (with the load average) and
each statistic's median and spread over the repeats. Measures only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _worker(rank: int, init_file: str, repeats: int, pairs: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from elixir_tune.hardware.bench_compute import ProbeBlock
    from elixir_tune.hardware.probe_common import CPU_BLOCKS
    from elixir_tune.hardware.timing import median_paired_extra_s
    from elixir_tune.hardware.workers import _all_gather_tensor

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        os.sched_setaffinity(0, {cores[rank * len(cores) // 2]})
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600)
    )
    batch, seq, hidden, heads = CPU_BLOCKS[0]
    block = ProbeBlock(hidden, heads)
    x = torch.randn(batch, seq, hidden, requires_grad=True)
    shard, full = torch.ones(256), torch.ones(512)

    def compute() -> None:
        block(x).sum().backward()

    def compute_then_gather() -> None:
        compute()
        _all_gather_tensor(full, shard)

    compute()
    compute_then_gather()
    results = []
    for _ in range(repeats):
        alone: list[float] = []
        gather: list[float] = []
        for _ in range(pairs):
            for times, fn in ((alone, compute), (gather, compute_then_gather)):
                dist.barrier()
                begin = time.perf_counter()
                fn()
                times.append(time.perf_counter() - begin)
        both = torch.tensor(
            [statistics.median(gather) - statistics.median(alone), median_paired_extra_s(alone, gather)],
            dtype=torch.float64,
        )
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        old_s, paired_s = both.tolist()
        results.append(
            {
                "difference_of_medians_ms": max(0.0, old_s) * 1e3,
                "median_of_paired_differences_ms": paired_s * 1e3,
                "block_ms": statistics.median(alone) * 1e3,
                "load_avg_1min": os.getloadavg()[0],
            }
        )
    dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=8, help="latency estimates per statistic")
    parser.add_argument("--pairs", type=int, default=50, help="pairs behind each estimate")
    args = parser.parse_args()
    if args.repeats < 2 or args.pairs < 1:
        parser.error("--repeats must be at least 2 and --pairs at least 1")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="latency-stats-") as tmp:
        out_path = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), args.repeats, args.pairs, out_path), nprocs=2)
        results = json.loads(Path(out_path).read_text())
    for row in results:
        print(", ".join(f"{key} {value:.3f}" for key, value in row.items()))
    for key in ("difference_of_medians_ms", "median_of_paired_differences_ms"):
        values = [row[key] for row in results]
        middle = statistics.median(values)
        spread = (max(values) - min(values)) / middle if middle else float("nan")
        print(
            f"{key}: median {middle:.3f}, min {min(values):.3f}, max {max(values):.3f}, (max - min) / median {spread:.0%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
