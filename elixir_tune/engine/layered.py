"""Layered gradient accumulation (Lamy-Poirier 2021, arXiv 2106.02679): all micro-batches of a step
go through the model layer by layer, forward and backward.

How, without touching the model's code: each micro-batch's forward runs in its own Python thread,
and the threads pass a baton in the engine's forward pre-hook of every module that owns chunked
parameters (``ModulePasses.pre_forward``: a layer, at a finer grain than the paper's blocks). The baton
goes to the thread that is furthest behind, the lowest micro-batch first on ties, so the unmodified
forward executes layer-major: micro-batch 0 runs layer k, then micro-batch 1 runs layer k, ..., then
micro-batch 0 runs layer k+1. Only one thread runs at a time, so the engine (cache, hooks,
collectives) sees one sequential stream of module calls, the same on every rank, and a chunk is
fetched once for all micro-batches whenever the cache holds one layer's chunks (the plan's minimum).

Backward needs no scheduling of its own: one ``torch.autograd.backward`` over the N losses runs the
autograd engine's ready queue, which takes the ready node with the highest sequence number first.
Sequence numbers are counted per thread, and the N threads ran the same code on inputs of the same
shape, so node j of every micro-batch carries the same number: the engine walks the N graphs in
lockstep, layer k of every micro-batch before layer k-1 of any (``tests/unit/test_layered.py``
checks the order). Each parameter's gradient accumulator has an input from every micro-batch, so
the autograd engine sums them before it runs once: the engine's post-accumulate-grad hook sees the
step's gradient once, stages it once and reduce-scatters each chunk once per step. Should the
micro-batches take different paths (data-dependent control flow), the numbers drift apart and the
backward order only approximates layer-major: more fetches, the same gradients.

The threads live as long as the model (``MicroBatchThreads``): a thread's first torch ops pay a
per-thread start-up of milliseconds (measured on the CPU: 1-7 ms for the first 64x64 matmul in a new
thread, 15 us after), which new threads every step would pay again, micro-batch by micro-batch.
Grad mode and autocast are thread-local in PyTorch: each thread takes the caller's. An exception in
one thread stops the others at their next layer and is raised in the caller.
Checkpointed blocks recompute in backward, in the autograd engine's thread, where the baton is not
active (hooks from threads outside the step pass straight through): one micro-batch at a time, so a
cache smaller than a block's chunks fetches them again for each (the cost model's layered trace
counts it: ``costmodel/trace.py``).

Why not torch's pipelining package (``PipelineStage``, ``ScheduleLoopedBFS``): it needs the model
split into stage modules (an export trace of the forward, which transformers models'
data-dependent Python does not always survive) and its schedules move activations between stages
with point-to-point sends; on one rank the threaded forward gives the same layer-major order on the
unmodified module, with nothing to split.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from elixir_tune.device import thread_device_carrier


class _Aborted(Exception):
    """Another micro-batch's thread failed: this one stops at its next layer."""


class Baton:
    """Lets N micro-batch threads run one at a time, layer by layer.

    Each thread counts the layers it has entered (its segment); the thread allowed to run
    is the unfinished one with the lowest (segment, index).

    Args:
        count: number of micro-batches (threads).
    """

    def __init__(self, count: int):
        self.count = count
        self.segment = [0] * count
        self.done = [False] * count
        self.failed = False
        self._index: dict[int, int] = {}  # thread ident -> micro-batch index
        self._lock = threading.Lock()
        # One condition per thread on the shared lock: a hand-over wakes only the next thread (waking
        # all N at every layer costs N thread switches each on a loaded CPU).
        self._conds = [threading.Condition(self._lock) for _ in range(count)]

    def _turn(self) -> int | None:
        waiting = [(self.segment[i], i) for i in range(self.count) if not self.done[i]]
        return min(waiting)[1] if waiting else None

    def _hand_over(self) -> None:
        """Wakes the thread whose turn it is now (all of them after a failure). Lock held."""
        if self.failed:
            for cond in self._conds:
                cond.notify_all()
            return
        turn = self._turn()
        if turn is not None:
            self._conds[turn].notify()

    def register(self, index: int) -> None:
        """Called by micro-batch thread ``index`` first thing: waits for its first turn."""
        with self._lock:
            self._index[threading.get_ident()] = index
            self._wait(index)

    def _wait(self, index: int) -> None:
        """Lock held."""
        self._conds[index].wait_for(lambda: self.failed or self._turn() == index)
        if self.failed:
            raise _Aborted

    def boundary(self) -> None:
        """A layer starts: the calling micro-batch thread yields to the one furthest behind.

        A call from any other thread (the caller's own forward, a recomputation in backward) returns
        at once.
        """
        index = self._index.get(threading.get_ident())
        if index is None:
            return
        with self._lock:
            self.segment[index] += 1
            if self._turn() == index:
                return  # still this thread's turn (the others are done)
            self._hand_over()
            self._wait(index)

    def finish(self, index: int, failed: bool) -> None:
        with self._lock:
            self.done[index] = True
            self.failed = self.failed or failed
            self._hand_over()


def _autocast_states() -> list[tuple[str, torch.dtype]]:
    """The caller's enabled autocast contexts (device type, dtype): thread-local, so re-entered per thread."""
    states = []
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            states.append((device_type, torch.get_autocast_dtype(device_type)))
    return states


class MicroBatchThreads:
    """One long-lived thread per micro-batch, reused step after step.

    Every micro-batch of a step must hold a thread at once (they wait for each other's turns), so
    the pool always has at least as many threads as the step has micro-batches; it is rebuilt,
    larger, when a step brings more.
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._size = 0

    def run(self, fn: Callable[[int], None], count: int) -> None:
        """Runs ``fn(i)`` for i in range(count), each in its own thread, and waits for all."""
        if self._executor is None or self._size < count:
            self.close()
            self._executor = ThreadPoolExecutor(max_workers=count, thread_name_prefix="elixir-micro-batch")
            self._size = count
        for future in [self._executor.submit(fn, i) for i in range(count)]:
            future.result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def run_layer_major(
    forward_loss: Callable[[int], torch.Tensor],
    count: int,
    set_baton: Callable[[Baton | None], None],
    threads: MicroBatchThreads,
) -> list[torch.Tensor]:
    """Runs ``forward_loss(i)`` for i in range(count) layer-major, one thread per micro-batch.

    Args:
        forward_loss: the forward of micro-batch i up to its (scaled) loss.
        count: number of micro-batches.
        set_baton: makes the engine's hooks see the step's baton (None again when done).
        threads: the threads to run them in (kept across steps).

    Returns:
        The N losses, in micro-batch order, attached to their graphs.

    Raises:
        The first exception a micro-batch raised.
    """
    baton = Baton(count)
    grad_enabled = torch.is_grad_enabled()
    autocasts = _autocast_states()
    on_this_device = thread_device_carrier()  # CUDA's current device and stream are per thread
    losses: list[torch.Tensor | None] = [None] * count
    errors: list[BaseException | None] = [None] * count

    def run(index: int) -> None:
        failed = False
        try:
            with on_this_device():
                baton.register(index)
                with torch.set_grad_enabled(grad_enabled):
                    contexts = [torch.autocast(device_type, dtype=dtype) for device_type, dtype in autocasts]
                    for context in contexts:
                        context.__enter__()
                    try:
                        losses[index] = forward_loss(index)
                    finally:
                        for context in reversed(contexts):
                            context.__exit__(None, None, None)
        except _Aborted:
            failed = True
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            errors[index] = error
            failed = True
        finally:
            baton.finish(index, failed)

    set_baton(baton)
    try:
        threads.run(run, count)  # run() catches everything: no future raises
    finally:
        set_baton(None)
    for error in errors:
        if error is not None:
            raise error
    assert all(loss is not None for loss in losses)
    return [loss for loss in losses if loss is not None]
