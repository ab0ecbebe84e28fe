"""Streams, events, pinned host memory and synchronisation: the CUDA-only calls, in one place.

On CUDA the engine overlaps work with streams (prefetch gathers on a side stream, gradient copies to
the host on a copy stream) and orders it with events; host buffers that cross the link are pinned.
A CPU device has none of these. Code that needs them asks a ``DeviceOps`` instead of calling
``torch.cuda``, and branches only on ``ops.streams``:

* ``CudaOps`` makes real streams and events and pins host memory;
* ``DeviceOps`` itself is the CPU: no streams (the stream paths take their CPU branch), no events,
  plain host memory, nothing to wait for.

A stand-in with ``streams = True`` runs the CUDA paths on CPU tensors: the unit tests record its
calls to check that every gather, copy and release waits for what it reads
(tests/unit/test_device_ops.py). The probe (``hardware/``) and the recipes use the same module, so
that ``torch.cuda`` is called here and nowhere else.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


class DeviceOps:
    """The device calls of a CPU device: no streams, no events, host memory not pinned.

    Every method is also the interface ``CudaOps`` implements. Streams and events are opaque
    values: only the ops that made them use them.

    Args:
        device: the compute device.
    """

    streams = False  # has streams and events: the overlapped (CUDA) paths run
    pinned = False  # host buffers that cross the link are page-locked

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    # --- streams and events ---------------------------------------------------------------------

    def new_stream(self) -> Any:
        """A stream of its own (None without streams)."""
        return None

    def current_stream(self) -> Any:
        """The stream work is queued on now (None without streams)."""
        return None

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Queues the work inside the ``with`` block on ``stream``."""
        return contextlib.nullcontext()

    def wait_stream(self, waiter: Any, waited: Any) -> None:
        """Work queued on ``waiter`` from now on starts after what ``waited`` holds now."""

    def record_event(self, stream: Any = None) -> Any:
        """An event marking what ``stream`` (default: the current one) holds now (None without streams)."""
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        """Work queued on ``stream`` from now on starts after ``event``."""

    def sync_event(self, event: Any) -> None:
        """The host waits until ``event`` has happened (None: nothing to wait for)."""

    def sync_stream(self, stream: Any) -> None:
        """The host waits until ``stream``'s work is done."""

    def synchronize(self) -> None:
        """The host waits for all work queued on the device."""

    # --- memory ---------------------------------------------------------------------------------

    def host_empty(self, numel: int, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
        """A 1-D host buffer, page-locked when this device pins (and ``pin``)."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.pinned and pin)

    def peak_memory_bytes(self) -> int | None:
        """Peak device memory allocated by tensors (None: the device is host memory)."""
        return None

    def empty_cache(self) -> None:
        """Returns the allocator's cached blocks to the device."""

    def set_device(self) -> None:
        """Makes this device the process's (or thread's) current one."""

    def device_scope(self) -> contextlib.AbstractContextManager:
        """Makes this device the current one inside the ``with`` block."""
        return contextlib.nullcontext()

    def time_s(self, fn: Callable[[], object]) -> float:
        """Seconds ``fn`` takes: wall time on the CPU, device time (events) on CUDA."""
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin


class CudaOps(DeviceOps):
    """The device calls of a CUDA device."""

    streams = True
    pinned = True

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter: Any, waited: Any) -> None:
        waiter.wait_stream(waited)

    def record_event(self, stream: Any = None) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)  # None: the current stream
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def sync_event(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def sync_stream(self, stream: Any) -> None:
        stream.synchronize()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def peak_memory_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def set_device(self) -> None:
        torch.cuda.set_device(self.device)

    def device_scope(self) -> contextlib.AbstractContextManager:
        return torch.cuda.device(self.device)

    def time_s(self, fn: Callable[[], object]) -> float:
        # Events on the current stream: what the GPU spent, not Python's launch overhead.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    # --- what the probe reads -------------------------------------------------------------------

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device)

    def total_memory_bytes(self) -> int:
        return int(torch.cuda.get_device_properties(self.device).total_memory)

    def free_memory_bytes(self) -> int:
        """Free device memory now, after returning the allocator's cached blocks."""
        torch.cuda.empty_cache()
        self.synchronize()
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def ops_for(device: torch.device | str) -> DeviceOps:
    """The device calls for ``device``: ``CudaOps`` on cuda, the CPU's otherwise."""
    device = torch.device(device)
    return CudaOps(device) if device.type == "cuda" else DeviceOps(device)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cuda_device_count() -> int:
    """GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count()


def cuda_properties(index: int) -> Any:
    """``torch.cuda.get_device_properties`` of GPU ``index`` (name, total_memory, ...)."""
    return torch.cuda.get_device_properties(index)


def pinned_host(num_bytes: int) -> torch.Tensor:
    """A page-locked host buffer of bytes (allocated pinned, not pinned by a copy)."""
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)


def thread_device_carrier() -> Callable[[], contextlib.AbstractContextManager]:
    """What makes another thread queue its work where this thread does now.

    CUDA's current device and stream are per thread: a worker thread starts on device 0's default
    stream. The returned factory gives a context that sets this thread's device and stream there
    (nothing when CUDA was never initialised here).
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return contextlib.nullcontext
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream()

    @contextlib.contextmanager
    def carried() -> Iterator[None]:
        torch.cuda.set_device(device)
        with torch.cuda.stream(stream):
            yield

    return carried
