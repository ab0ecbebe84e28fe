"""Gradient staging: a bounded pool of chunk buffers, and the overlapped copy-down to the host.

Backward copies each parameter's gradient into its chunk's staging buffer (compute dtype, the
whole chunk); a complete chunk is reduce-scattered from it into a shard-sized output. The pool holds
``staging_buffers`` such pairs, allocated once: when none is free, the engine finishes the oldest
reduction in flight, so staging never takes more than the plan says.

Gradients of offloaded chunks go down to the host as they are reduced: the reduced shard is copied
into a landing buffer of host memory (pinned on cuda, on a stream of its own, one event per chunk)
and a worker thread adds it into the fp32 host gradient once the copy's event has fired, while
backward goes on. On a cpu device the same worker thread waits for the reduction and adds the
reduced shard straight from the staging buffer into the host gradient: device and host are one
memory, so there is no landing buffer (and nothing to copy into it).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from elixir_tune.device import DeviceOps, ops_for
from elixir_tune.engine.chunks.host_memory import zeros_on_demand
from elixir_tune.engine.comm import Handle


@dataclass
class StagingBuffer:
    """One entry of the pool.

    Attributes:
        full: the chunk's gradients before reduction (compute dtype, device).
        out: this rank's reduced shard (a view of ``full`` with one rank).
        landing: host buffer the reduced shard of an offloaded chunk is copied into (None when no
            chunk is offloaded, and on a cpu device, where the shard is added from ``out``).
    """

    full: torch.Tensor
    out: torch.Tensor
    landing: torch.Tensor | None


class StagingPool:
    """``size`` staging buffers, allocated up front.

    Args:
        size: buffers in the pool (the plan's ``memory.staging_buffers``).
        chunk_size: elements per chunk.
        rank: this rank (its shard's place in the chunk, for a world of one).
        world_size: data-parallel size.
        dtype: compute dtype.
        device: the compute device.
        landing: allocate host landing buffers (some chunk is offloaded).
        ops: the device's calls (pinned memory); default ``ops_for(device)``.
    """

    def __init__(
        self,
        size: int,
        chunk_size: int,
        rank: int,
        world_size: int,
        dtype: torch.dtype,
        device: torch.device,
        landing: bool,
        ops: DeviceOps | None = None,
    ):
        if size < 1:
            raise ValueError(f"memory.staging_buffers must be at least 1, got {size}")
        shard = chunk_size // world_size
        self.size = size
        # acquire() zeroes a buffer as it hands it out, so the pool needs no zeros of its own: on a CPU device
        # its pages then cost memory from the first backward on, not from setup (host_memory.py; GPT-2 774M at
        # world 2 under the search's plan: two chunks of 64M fp32, 0.48 GiB of a setup peak of 2.86 GiB).
        if device.type == "cpu":
            self.full_block = zeros_on_demand(size * chunk_size, dtype)
        else:
            self.full_block = torch.zeros(size * chunk_size, dtype=dtype, device=device)
        self.out_block = torch.empty(size * shard if world_size > 1 else 0, dtype=dtype, device=device)
        self.landing_block = None
        if landing:
            self.landing_block = (ops if ops is not None else ops_for(device)).host_empty(size * shard, dtype)
        self._free: list[StagingBuffer] = []
        for i in range(size):
            full = self.full_block[i * chunk_size : (i + 1) * chunk_size]
            out = self.out_block[i * shard : (i + 1) * shard] if world_size > 1 else full[rank * shard :][:shard]
            land = self.landing_block[i * shard : (i + 1) * shard] if self.landing_block is not None else None
            self._free.append(StagingBuffer(full, out, land))
        self._free.reverse()  # hand out buffer 0 first
        self.live = 0  # buffers handed out and not yet released
        self.peak_live = 0

    def acquire(self) -> StagingBuffer | None:
        """A zeroed free buffer, or None when all are in use."""
        if not self._free:
            return None
        buffer = self._free.pop()
        buffer.full.zero_()
        self.live += 1
        self.peak_live = max(self.peak_live, self.live)
        return buffer

    def release(self, buffer: StagingBuffer) -> None:
        self.live -= 1
        self._free.append(buffer)

    def device_bytes(self) -> int:
        return self.full_block.nbytes + self.out_block.nbytes

    def landing_nbytes(self) -> int:
        return 0 if self.landing_block is None else self.landing_block.nbytes


class GradDrain:
    """Copies reduced shards of offloaded chunks to the host and accumulates them there, overlapped.

    Args:
        device: the compute device (cuda: the copies run on a stream of their own).
        ops: the device's streams and events; default ``ops_for(device)``.
    """

    def __init__(self, device: torch.device, ops: DeviceOps | None = None):
        self.device = device
        self.ops = ops if ops is not None else ops_for(device)
        self.stream = self.ops.new_stream() if self.ops.streams else None
        self._executor: ThreadPoolExecutor | None = None

    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:  # one thread: additions into a gradient keep their order
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elixir-grad-drain")
        return self._executor

    def submit(self, handle: Handle, buffer: StagingBuffer, grad: torch.Tensor) -> Future:
        """Starts moving ``buffer.out`` (once ``handle``'s reduce-scatter is done) into ``grad``.

        Returns:
            A future that completes when ``grad`` holds the addition.
        """
        landing = buffer.landing
        if self.stream is None:
            # cpu: the collective is waited for in the worker, so that backward goes on meanwhile;
            # the staging buffer stays ours until finish_reduce has the future's result.
            return self._worker().submit(_wait_add, handle, buffer.out, grad)
        assert landing is not None, "the grad drain needs a staging pool built with landing buffers on cuda"
        with self.ops.use_stream(self.stream):
            handle.wait()  # the copy stream (not the compute stream) waits for the reduce-scatter
            landing.copy_(buffer.out, non_blocking=True)
            event = self.ops.record_event(self.stream)
        return self._worker().submit(_sync_add, self.ops, event, landing, grad)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _wait_add(handle: Handle, out: torch.Tensor, grad: torch.Tensor) -> None:
    handle.wait()
    grad.add_(out)


def _sync_add(ops: DeviceOps, event, landing: torch.Tensor, grad: torch.Tensor) -> None:
    ops.sync_event(event)  # the copy into ``landing`` is done
    grad.add_(landing)
