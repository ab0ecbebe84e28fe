"""Starts N worker processes (gloo, CPU) the way torchrun would, with a free port and a timeout,
and runs the cases inside each worker (``worker_main``).

Each rank is forked from its own pre-imported zygote (worker_zygote.py, kept for the whole test session):
that saves the ~6 s of CPU a fresh interpreter spends importing torch and transformers, per rank and
launch. ``fresh=True`` (or ``ELIXIR_TEST_FRESH_WORKERS=1`` for every launch) starts fresh interpreters
instead, as before.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The torchrun environment of one rank, one CPU thread each, the repository on the path."""
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
    return env


class Zygote:
    """One pre-imported parent process (worker_zygote.py) that forks a worker on request."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "worker_zygote.py")],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._pending = b""  # answer bytes read but not yet parsed
        self.pid: int | None = None  # the worker it runs now
        self.started = False

    def wait_ready(self) -> None:
        """Waits for the zygote's imports (it answers ``{"ready": pid}``)."""
        if not self.started:
            if self._read(time.monotonic() + 600) is None:
                raise RuntimeError("the worker zygote did not finish its imports within 600 s")
            self.started = True

    def _read(self, deadline: float) -> dict | None:
        """The zygote's next answer, or None at the deadline. Reads the pipe's bytes itself: a buffered
        reader could hold a second answer that ``select`` then never reports."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            data = os.read(fd, 65536)
            if not data:
                raise RuntimeError(f"the worker zygote died (exit {self.proc.wait()})")
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def start(self, argv: list[str], env: dict[str, str], log: str) -> None:
        assert self.proc.stdin is not None
        request = {"argv": argv, "env": env, "log": log, "cwd": os.getcwd()}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        answer = self._read(time.monotonic() + 60)
        if answer is None:
            raise RuntimeError("the worker zygote did not fork within 60 s")
        self.pid = answer["pid"]

    def wait(self, deadline: float) -> int | None:
        """The worker's exit code, or None if it still runs at the deadline."""
        answer = self._read(deadline)
        if answer is None:
            return None
        self.pid = None
        return answer["exit"]

    def kill(self) -> None:
        """Kills the worker it runs, if any, and takes its exit answer (the next request starts clean)."""
        if self.pid is None or self.proc.poll() is not None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.wait(time.monotonic() + 60) is None:  # not answering: replaced at the next launch
            self.proc.kill()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_ZYGOTES: list[Zygote] = []


def zygotes(count: int) -> list[Zygote]:
    """The first ``count`` zygotes of this session (started together on first use, closed at exit)."""
    for index, zygote in enumerate(_ZYGOTES):
        if zygote.proc.poll() is not None:  # died: start another in its place
            _ZYGOTES[index] = Zygote()
    while len(_ZYGOTES) < count:
        if not _ZYGOTES:
            atexit.register(lambda: [z.close() for z in _ZYGOTES])
        _ZYGOTES.append(Zygote())
    for zygote in _ZYGOTES[:count]:
        zygote.wait_ready()
    return _ZYGOTES[:count]


class FreshWorker:
    """A rank started as a fresh interpreter (``fresh=True``): the same interface as a forked one."""

    def __init__(self, argv: list[str], env: dict[str, str], log: str) -> None:
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, *argv], env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait(self, deadline: float) -> int | None:
        try:
            return self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def launch(
    script: str, cases: list[dict], world_size: int, timeout_s: float = 240.0, fresh: bool = False
) -> list[list[dict]]:
    """Runs ``script cases.json out`` on ``world_size`` ranks; returns each rank's results.

    Args:
        script: the worker script, a path relative to this folder (or absolute).
        cases: the cases every rank runs, in order.
        world_size: the number of ranks.
        timeout_s: the whole launch's limit.
        fresh: start each rank as a fresh interpreter instead of forking it from a zygote.

    Raises:
        RuntimeError: a rank failed or the run timed out (all ranks are killed).
    """
    fresh = fresh or os.environ.get("ELIXIR_TEST_FRESH_WORKERS") == "1"
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cases_path = Path(tmp, "cases.json")
        cases_path.write_text(json.dumps(cases))
        out = str(Path(tmp, "out"))
        argv = [str(HERE / script), str(cases_path), out]
        logs = [str(Path(tmp, f"log.rank{rank}")) for rank in range(world_size)]
        workers: list[Zygote] | list[FreshWorker] = []
        codes: list[int | None] = []
        try:
            if fresh:
                deadline = time.monotonic() + timeout_s
                workers = [FreshWorker(argv, worker_env(r, world_size, port), logs[r]) for r in range(world_size)]
            else:
                workers = zygotes(world_size)
                # From here: a zygote's first start (imports, minutes on a loaded machine) is not the launch's time.
                deadline = time.monotonic() + timeout_s
                for rank, zygote in enumerate(workers):
                    zygote.start(argv, worker_env(rank, world_size, port), logs[rank])
            codes = [worker.wait(deadline) for worker in workers]
        finally:  # a timeout, or an error while starting: no rank may outlive the launch
            for rank, worker in enumerate(workers):
                if rank >= len(codes) or codes[rank] is None:
                    worker.kill()
        if None in codes:
            raise RuntimeError(f"{script} timed out after {timeout_s}s on {world_size} ranks")
        failed = [(rank, code, Path(logs[rank]).read_text()[-3000:]) for rank, code in enumerate(codes) if code]
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
