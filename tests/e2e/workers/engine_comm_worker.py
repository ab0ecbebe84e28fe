"""A worker whose process group is the engine's (engine/comm/mesh.py init_comm, with its collective
timeout): all-reduces forever so that a test can stop, hang or kill one rank.

Each rank writes ``rank<R>.json`` (pid, rank, the timeout it was given) into --out once the group
is up. --hang-rank R makes rank R stop taking part after the first all-reduce (it sleeps in Python,
as a rank stuck in its own code would).
"""

import argparse
import json
import os
import time

import torch

from elixir_tune.engine.comm import init_comm
from elixir_tune.engine.worker import collective_timeout_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--hang-rank", type=int, default=-1)
    args = parser.parse_args()
    comm = init_comm(int(os.environ["WORLD_SIZE"]), "cpu", "gloo")
    with open(os.path.join(args.out, f"rank{comm.rank}.json"), "w") as file:
        json.dump({"pid": os.getpid(), "rank": comm.rank, "timeout_s": collective_timeout_s()}, file)
    while True:
        comm.all_reduce_sum(torch.ones(4))
        if comm.rank == args.hang_rank:
            while True:
                time.sleep(1)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
