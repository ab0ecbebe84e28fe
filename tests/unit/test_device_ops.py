"""The engine's stream paths (CUDA's) run on the CPU with a recording stand-in for the device calls.

``RecordingOps`` says it has streams, so the chunk's side-stream gather, the gradient drain's copy
stream and the finite check's event take the branch they take on CUDA; it records every stream wait,
event record and host sync. The tests check the order that keeps CUDA correct: a prefetched chunk is
bound and freed only after the compute stream waited for its gather, the upload copy is rewritten only
after the copy reading it is done, and a staging buffer is reused only after its copy to the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from elixir_tune.device import CudaOps, DeviceOps, ops_for
from elixir_tune.engine.chunks.cache import ChunkCache
from elixir_tune.engine.chunks.chunk import Chunk
from elixir_tune.engine.chunks.staging import GradDrain, StagingPool
from elixir_tune.engine.comm import Comm
from elixir_tune.engine.finite import FiniteGuard
from elixir_tune.errors import NonFiniteError

CPU = torch.device("cpu")
LOCAL = Comm(0, 1, "local", CPU)


@dataclass(frozen=True)
class Event:
    name: str
    stream: str


class RecordingOps(DeviceOps):
    """Streams are names, events are records; every call is logged. ``on_sync`` runs before a host sync."""

    streams = True

    def __init__(self):
        super().__init__(CPU)
        self.log: list[tuple] = []
        self._current = ["compute"]
        self._made = 0
        self.on_sync: Callable[[Event], None] | None = None

    def new_stream(self) -> str:
        self._made += 1
        return f"side{self._made}"

    def current_stream(self) -> str:
        return self._current[-1]

    @contextlib.contextmanager
    def use_stream(self, stream) -> Iterator[None]:
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def wait_stream(self, waiter, waited) -> None:
        self.log.append(("wait_stream", waiter, waited))

    def record_event(self, stream=None) -> Event:
        event = Event(f"e{len(self.log)}", stream or self.current_stream())
        self.log.append(("record", event.name, event.stream))
        return event

    def wait_event(self, stream, event) -> None:
        self.log.append(("wait_event", stream, event.name))

    def sync_event(self, event) -> None:
        if event is None:
            return
        if self.on_sync is not None:
            self.on_sync(event)
        self.log.append(("sync", event.name))


def offloaded_chunks(ops: DeviceOps, n: int) -> list[Chunk]:
    chunks = []
    for i in range(n):
        param = torch.nn.Parameter(torch.full((4,), float(i + 1)))
        chunk = Chunk(i, [(f"p{i}", param)], 8, LOCAL, torch.float32, CPU, False, True, ops=ops)
        chunk.init_master(chunk.flat_from_params())
        chunks.append(chunk)
    return chunks


def logging_frees(ops: RecordingOps, chunks: list[Chunk]) -> None:
    for chunk in chunks:
        free = chunk.free

        def logged(chunk=chunk, free=free) -> None:
            ops.log.append(("free", chunk.id))
            free()

        chunk.free = logged  # type: ignore[method-assign]


def test_a_prefetch_is_gathered_on_the_side_stream_and_read_and_freed_only_after_the_compute_stream_waits():
    ops = RecordingOps()
    chunks = offloaded_chunks(ops, 3)
    logging_frees(ops, chunks)
    bound_at_wait = []
    wait_event = ops.wait_event

    def noting_wait(stream, event) -> None:
        bound_at_wait.append(chunks[1].fresh)
        wait_event(stream, event)

    ops.wait_event = noting_wait  # type: ignore[method-assign]
    cache = ChunkCache(chunks, 2, 1, lambda chunk: torch.full((1,), float("nan")), side_stream=ops.new_stream())
    cache.start_microbatch()
    cache.fetch([chunks[0]], "m0")  # on demand, on the compute stream; then chunk 1 is prefetched on side1
    assert ops.log == [
        ("record", "e0", "compute"),  # chunk 0's upload copy, on the compute stream
        ("wait_stream", "side1", "compute"),  # the prefetch starts after the shard's last update
        ("record", "e2", "side1"),  # chunk 1's upload copy, queued on the side stream
        ("record", "e3", "side1"),  # the gather's end
    ]
    assert not chunks[1].fresh
    cache.fetch([chunks[1]], "m1")
    assert ops.log[4] == ("wait_event", "compute", "e3")
    assert bound_at_wait == [False]  # bound after the wait, not before
    assert chunks[1].fresh and torch.equal(chunks[1].slots[0].param.data, torch.full((4,), 2.0))
    cache.fetch([chunks[2]], "m2")  # two slots: one chunk goes
    frees = [entry for entry in ops.log if entry[0] == "free"]
    assert frees and ops.log.index(frees[0]) > 4  # a chunk's memory is released after the wait, never before
    cache.release_all()
    assert all(chunk.payload_bytes() == 0 for chunk in chunks)


def test_the_upload_copy_is_rewritten_only_after_the_copy_reading_it_is_done():
    ops = RecordingOps()
    (chunk,) = offloaded_chunks(ops, 1)
    chunk.gather(async_op=False, side_stream=None).wait()
    assert chunk.upload_event is not None
    seen = []
    ops.on_sync = lambda event: seen.append(chunk.upload.clone())
    chunk.set_master(torch.full((8,), 7.0))
    assert ops.log[-1] == ("sync", chunk_event_name(ops))
    assert torch.equal(seen[0][:4], torch.full((4,), 1.0))  # still the old weights when the copy was waited for
    assert torch.equal(chunk.upload, torch.full((8,), 7.0))
    assert chunk.upload_event is None


def chunk_event_name(ops: RecordingOps) -> str:
    return next(entry[1] for entry in ops.log if entry[0] == "record")


def test_a_reduced_shard_is_copied_on_the_copy_stream_added_after_its_event_and_its_buffer_then_reused():
    ops = RecordingOps()
    (chunk,) = offloaded_chunks(ops, 1)
    pool = StagingPool(1, 8, 0, 1, torch.float32, CPU, landing=True, ops=ops)
    drain = GradDrain(CPU, ops)
    buffer = pool.acquire()
    assert buffer is not None and buffer.landing is not None
    buffer.full.copy_(torch.arange(8.0))
    chunk.staging = buffer
    at_sync = []
    ops.on_sync = lambda event: at_sync.append((chunk.grad.clone(), buffer.landing.clone()))
    try:
        chunk.start_reduce(drain)
        released = chunk.finish_reduce()
        ops.log.append(("release",))
        pool.release(released)
    finally:
        drain.close()
    record = next(entry for entry in ops.log if entry[0] == "record")
    assert record[2] == "side1"  # the copy down is queued on the drain's own stream
    assert ops.log.index(("sync", record[1])) < ops.log.index(("release",))
    grad_then, landing_then = at_sync[0]
    assert torch.equal(grad_then, torch.zeros(8))  # nothing added before the copy's event
    assert torch.equal(landing_then, torch.arange(8.0))  # the copy is in the landing buffer
    assert torch.equal(chunk.grad, torch.arange(8.0))
    assert pool.acquire() is released


def test_the_finite_check_reads_its_host_copy_only_after_the_event():
    ops = RecordingOps()
    guard = FiniteGuard(CPU, "fp32", ops)
    guard.record(1, torch.tensor(float("inf")), torch.zeros(()))  # with streams: no check yet
    assert [entry[0] for entry in ops.log] == ["record"]
    with pytest.raises(NonFiniteError, match="optimizer step 1"):
        guard.check()
    assert [entry[0] for entry in ops.log] == ["record", "sync"]


def test_the_cpu_takes_the_branch_without_streams():
    ops = ops_for("cpu")
    assert type(ops) is DeviceOps and not ops.streams and ops.new_stream() is None
    assert type(ops_for(torch.device("cuda", 0))) is CudaOps
    (chunk,) = offloaded_chunks(ops, 1)
    chunk.gather(async_op=False).wait()
    assert chunk.upload_event is None
    assert not ops.host_empty(4, torch.float32).is_pinned()
