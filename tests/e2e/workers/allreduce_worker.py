"""A plain torch.distributed worker for launcher tests: all-reduces in a loop, reports what it saw.

Started by elixir-run under torchrun. Each rank writes ``rank<R>.json`` into --out at start-up
(pid, ranks, world size, the plan path and thread count it was given), all-reduces a tensor
--iterations times (0: forever, so a test can kill it), then writes ``done<R>.json``.
--fail-rank R --exit-code C makes rank R exit with code C after the first all-reduce.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--exit-code", type=int, default=3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    info = {
        "pid": os.getpid(),
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "plan": os.environ.get("ELIXIR_TUNE_PLAN"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "argv": sys.argv[1:],
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as file:
        json.dump(info, file)
    print(f"worker rank {rank}/{world} pid {os.getpid()} ready", flush=True)

    iteration, total = 0, 0.0
    while args.iterations == 0 or iteration < args.iterations:
        value = torch.ones(4) * (rank + 1)
        dist.all_reduce(value)
        total += float(value[0])
        iteration += 1
        if rank == args.fail_rank:
            print(f"worker rank {rank} exits with code {args.exit_code} on purpose", flush=True)
            # os._exit, not sys.exit: interpreter teardown with gloo's threads still in a collective
            # can abort (SIGABRT) instead of exiting with the code, which is not what this tests.
            os._exit(args.exit_code)
        if args.iterations == 0:
            time.sleep(0.05)
    with open(os.path.join(args.out, f"done{rank}.json"), "w") as file:
        json.dump({**info, "sum": total}, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
