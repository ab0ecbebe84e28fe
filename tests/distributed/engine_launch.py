"""Starts N worker processes (gloo, CPU) the way torchrun would, with a free port and a timeout,
and runs the cases inside each worker (``worker_main``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(script: str, cases: list[dict], world_size: int, timeout_s: float = 240.0) -> list[list[dict]]:
    """Runs ``script cases.json out`` on ``world_size`` ranks; returns each rank's results.

    Raises:
        RuntimeError: a rank failed or the run timed out (all ranks are killed).
    """
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cases_path = Path(tmp, "cases.json")
        cases_path.write_text(json.dumps(cases))
        out = str(Path(tmp, "out"))
        procs = []
        for rank in range(world_size):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(REPO),
                PYTHONWARNINGS="ignore",
            )
            env.pop("ELIXIR_TUNE_PLAN", None)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / script), str(cases_path), out],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        logs = []
        try:
            for proc in procs:
                logs.append(proc.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for proc in procs:
                proc.kill()
            raise RuntimeError(f"{script} timed out after {timeout_s}s on {world_size} ranks") from None
        failed = [(rank, proc.returncode, logs[rank][-3000:]) for rank, proc in enumerate(procs) if proc.returncode]
        if failed:
            raise RuntimeError(f"{script} failed: {failed}")
        return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(world_size)]


def worker_main(run_case: Callable[[dict, int, int, int, str], dict]) -> None:
    """A worker's main: runs ``run_case(case, index, rank, world, out_path)`` for each case of
    ``argv[1]`` and writes the results where ``launch`` reads them.

    A case that raises is reported as ``{"ok": False, "error", "trace"}`` and the next case runs,
    so that one failure does not leave the other ranks waiting in a collective.
    """
    import traceback

    import torch

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cases = json.loads(open(sys.argv[1]).read())
    out_path = sys.argv[2]
    torch.set_num_threads(1)
    results = []
    for index, case in enumerate(cases):
        try:
            results.append(dict(run_case(case, index, rank, world, out_path), ok=True))
        except Exception as exc:  # report, keep the ranks in step for the next case
            results.append(
                {
                    "case": case,
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc()[-3000:],
                }
            )
    with open(f"{out_path}.rank{rank}.json", "w") as f:
        json.dump(results, f)
    import torch.distributed as dist

    if world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
