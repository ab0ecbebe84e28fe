"""The cost of handing the interpreter from one Python thread to another.

Layered gradient accumulation runs each micro-batch's forward in its own thread and passes a
baton between them at every layer (``engine/layered.py``): one hand-over per layer and
micro-batch. Each wakes a sleeping thread through a condition variable, which then needs the
GIL and a core; on a small virtual machine that takes hundreds of microseconds (measured: about
0.1-0.25 ms on a 2-core VM), as much as a small layer's compute. The engine cannot be imported
here (the probe stays below it), so this measures the same pattern: threads that take turns
through one condition per thread on a shared lock, with a small matmul between turns. The work
matters: a torch op that releases the GIL, as a layer's ops do, made hand-overs several times
slower than an op too small to release it (measured on the CPU: about 110-150 us against 25 us).
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

_THREADS = 4
_TURNS = 25  # per thread and round


def _round_s(work) -> float:
    """One round: ``_THREADS`` threads take ``_TURNS`` turns each, in order; its seconds."""
    lock = threading.Lock()
    conds = [threading.Condition(lock) for _ in range(_THREADS)]
    state = {"turn": 0}

    def run(index: int) -> None:
        for _ in range(_TURNS):
            with lock:
                conds[index].wait_for(lambda: state["turn"] == index)
            work()
            with lock:
                state["turn"] = (index + 1) % _THREADS
                conds[state["turn"]].notify()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(_THREADS)]
    begin = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - begin


def thread_handoff_s(budget_s: float) -> float:
    """Median seconds of one hand-over between Python threads, net of the work between turns.

    Args:
        budget_s: time to spend, roughly.

    Returns:
        Seconds per hand-over.
    """
    a, b = torch.ones(64, 64), torch.ones(64, 64)
    out = torch.empty(64, 64)

    def work() -> None:
        torch.mm(a, b, out=out)

    handoffs = _THREADS * _TURNS
    work_begin = time.perf_counter()
    for _ in range(handoffs):
        work()
    work_s = time.perf_counter() - work_begin
    rounds: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(rounds) < 3 or (time.perf_counter() < deadline and len(rounds) < 50):
        rounds.append(_round_s(work))
    return max(0.0, (statistics.median(rounds) - work_s) / handoffs)
