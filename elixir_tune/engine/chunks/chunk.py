"""Chunks: flat buffers holding whole parameters, sharded over the data-parallel ranks.

Each parameter starts at an aligned offset (``elixir_tune.plan.memory.padded_offsets``: 16 bytes
in bf16, as FSDP pads) so that kernels see aligned views; the padding stays zero. A plan packed
before alignment existed (its parameters do not fit padded) is laid out back to back, as packed.

A chunk of ``chunk_size`` elements is cut into ``world_size`` equal shards; this rank owns
``[rank * shard, (rank + 1) * shard)``. The shard's fp32 master weights and gradient live on the
device, or in host memory when the chunk is offloaded (the host path uses its own buffers and
explicit copies, also on a cpu device, so that CI exercises it).

An offloaded shard also keeps a compute-dtype copy of its master in host memory: that copy, not
the fp32 master, crosses the host->device link on every gather. In fp32 the copy is the master
itself (one buffer, no second copy): on a cpu device, where device and host are one memory, an
offloaded fp32 chunk then holds exactly what a device chunk holds.

A frozen chunk (parameters with requires_grad False: a LoRA base model) keeps only the weights, in
the compute dtype: its "master" is that shard (on the host, the upload copy itself), it has no
gradient (an empty tensor), no optimizer state and is never reduced. It is gathered, cached and
released like any chunk: backward gathers it too, since the input gradient of a frozen layer needs
its weights.

The gathered copy (the "payload", compute dtype, all ``chunk_size`` elements) has a storage of its
own that is allocated when the chunk enters the cache and freed when it leaves (storage resize, as
FSDP does). Keeping one storage per chunk matters: autograd saves views of parameters, and those
views must see the chunk's data again after it is evicted and gathered back in backward or in a
recomputation, whichever cache slot it went through.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from elixir_tune.device import DeviceOps, ops_for
from elixir_tune.engine.chunks.host_memory import zeros_on_demand
from elixir_tune.engine.chunks.staging import GradDrain, StagingBuffer
from elixir_tune.engine.chunks.states import GRAD_STAGED, TensorState, transition
from elixir_tune.engine.comm import DONE, Comm, Handle
from elixir_tune.engine.parallel.tensor_parallel import local_data, set_local_data
from elixir_tune.plan.memory import padded_offsets


@dataclass
class ParamSlot:
    """Where one parameter lives in its chunk."""

    name: str
    param: torch.nn.Parameter
    chunk: Chunk
    index: int  # position inside the chunk
    offset: int  # first element inside the chunk
    numel: int
    shape: torch.Size
    state: TensorState = TensorState.FREE
    awaiting_grad: bool = False  # its module's backward has started, its gradient has not arrived


class Chunk:
    """One chunk: layout, this rank's shard buffers and the gathered payload.

    Args:
        chunk_id: position in first-use order.
        named_params: (name, parameter) in packing order.
        chunk_size: elements per chunk (multiple of the world size).
        comm: the data-parallel group.
        compute_dtype: dtype of the gathered payload and of gradients before reduction.
        device: the compute device.
        resident: the payload is never released.
        offload: the shard lives in host memory.
        upload: for an offloaded chunk, the host buffer (``shard_numel`` elements, compute dtype)
            of its upload copy; allocated here when None.
        frozen: the parameters are not trained: the shard holds compute-dtype weights only.
        grad_divisor: what the summed gradients are divided by; None: ``comm``'s size (the mean over
            the data group). An expert chunk (engine/parallel/expert_parallel.py) is sharded over its
            expert-data group but divides by the whole data size; it reduces into a shard buffer of
            its own, as the staging pool's are cut for the data group (and, offloaded on cuda, lands
            in a host buffer of its own).
        ops: the device's streams, events and pinned memory (default: ``ops_for(device)``).
    """

    def __init__(
        self,
        chunk_id: int,
        named_params: list[tuple[str, torch.nn.Parameter]],
        chunk_size: int,
        comm: Comm,
        compute_dtype: torch.dtype,
        device: torch.device,
        resident: bool,
        offload: bool,
        upload: torch.Tensor | None = None,
        frozen: bool = False,
        grad_divisor: int | None = None,
        ops: DeviceOps | None = None,
    ):
        self.ops = ops if ops is not None else ops_for(device)
        self.grad_divisor = grad_divisor
        self.id = chunk_id
        self.frozen = frozen
        self.chunk_size = chunk_size
        self.comm = comm
        self.compute_dtype = compute_dtype
        self.device = device
        self.resident = resident
        self.offload = offload
        self.shard_numel = chunk_size // comm.world_size
        self.shard_begin = comm.rank * self.shard_numel
        # A tensor-parallel parameter is a DTensor: the chunk holds its local piece (local_data).
        numels = [local_data(param).numel() for _, param in named_params]
        offsets, end = padded_offsets(numels)
        self.aligned = end <= chunk_size
        if not self.aligned:
            # A plan packed before parameters were aligned: back to back, as it was packed.
            offsets = [sum(numels[:i]) for i in range(len(numels))]
            end = sum(numels)
        if end > chunk_size:
            raise ValueError(f"chunk {chunk_id}: its parameters hold {end} elements, more than chunk_size {chunk_size}")
        self.slots: list[ParamSlot] = [
            ParamSlot(name, param, self, index, offset, local_data(param).numel(), local_data(param).shape)
            for index, ((name, param), offset) in enumerate(zip(named_params, offsets, strict=True))
        ]
        self.numel = end

        self.upload: torch.Tensor | None
        if frozen:
            # Weights only, in the compute dtype: nothing to update, so no fp32 master, no gradient.
            if offload:
                self.upload = upload if upload is not None else torch.empty(self.shard_numel, dtype=compute_dtype)
                self.master = self.upload
            else:
                self.upload = None
                self.master = torch.zeros(self.shard_numel, dtype=compute_dtype, device=device)
            self.grad = torch.zeros(0, dtype=torch.float32, device=self.master.device)
        elif offload:
            # Host path (also on a cpu device, so that CI exercises it): fp32 master, gradient and
            # optimizer state in host memory, and a compute-dtype copy of the master that is what
            # goes up to the device (pinned on cuda; in fp32 the master itself).
            if upload is None:
                upload = torch.empty(self.shard_numel, dtype=compute_dtype)
            self.upload = upload
            self.master = upload if compute_dtype == torch.float32 else torch.zeros(self.shard_numel)
            self.grad = zeros_on_demand(self.shard_numel)  # zero until the first backward writes it
        else:
            self.upload = None
            self.master = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
            if device.type == "cpu":
                self.grad = zeros_on_demand(self.shard_numel)
            else:
                self.grad = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
        # An offloaded expert chunk's reduced shard lands here on cuda (the pool's landing buffers are
        # cut for the data group's shards); on a cpu device the drain adds it from the device buffer.
        self.landing: torch.Tensor | None = None
        if grad_divisor is not None and offload and not frozen and self.ops.streams:
            self.landing = self.ops.host_empty(self.shard_numel, compute_dtype)
        self.upload_event: Any = None  # with streams: the last host->device copy reading ``upload``
        self.payload = torch.empty(chunk_size, dtype=compute_dtype, device=device)
        self.payload.untyped_storage().resize_(0)
        self.allocated = False  # payload storage present
        self.fresh = False  # payload holds the current weights
        self.staging: StagingBuffer | None = None  # gradients of this backward, compute dtype
        self.staged = 0  # parameters whose gradient is in ``staging``
        self.received = 0  # parameters whose gradient arrived in this backward
        self.pending: tuple[StagingBuffer, Handle | Future, torch.Tensor] | None = None  # reduction in flight
        # Flat per-element optimizer state over the shard (ShardedOptimizer preallocates it).
        self.optimizer_flats: dict[str, torch.Tensor] = {}
        self.optimizer_state_bytes = 0

    # --- layout -------------------------------------------------------------------------------

    def owned_range(self, slot: ParamSlot) -> tuple[int, int] | None:
        """The part of ``slot`` inside this rank's shard, as [begin, end) offsets into the shard."""
        begin = max(slot.offset, self.shard_begin)
        end = min(slot.offset + slot.numel, self.shard_begin + self.shard_numel)
        if begin >= end:
            return None
        return begin - self.shard_begin, end - self.shard_begin

    def init_master(self, full_or_shard_fp32: torch.Tensor) -> None:
        """Sets this rank's master shard from the full fp32 chunk or from this rank's shard of it (padding zero)."""
        if full_or_shard_fp32.numel() == self.shard_numel:
            self.set_master(full_or_shard_fp32)
            return
        self.set_master(full_or_shard_fp32[self.shard_begin : self.shard_begin + self.shard_numel])

    def set_master(self, shard_fp32: torch.Tensor) -> None:
        """Sets this rank's master shard (``shard_numel`` elements) and refreshes its upload copy.

        Every write to a master goes through here or through the optimizer step, which calls
        ``refresh_upload`` after it.
        """
        self.wait_upload()
        self.master.copy_(shard_fp32)
        self.refresh_upload()

    def wait_upload(self) -> None:
        """Waits until no host->device copy still reads the upload copy (before writing it)."""
        if self.upload_event is not None:
            self.ops.sync_event(self.upload_event)
            self.upload_event = None

    def refresh_upload(self) -> None:
        """Casts the fp32 master into the compute-dtype upload copy (offloaded chunks)."""
        if self.upload is not None and self.upload is not self.master:
            self.wait_upload()
            self.upload.copy_(self.master)

    def flat_from_params(self) -> torch.Tensor:
        """The full chunk built from the parameters' current data, fp32, on the device."""
        flat = torch.zeros(self.chunk_size, dtype=torch.float32, device=self.device)
        for slot in self.slots:
            flat[slot.offset : slot.offset + slot.numel].copy_(local_data(slot.param).reshape(-1))
        return flat

    # --- gather / release ----------------------------------------------------------------------

    def allocate(self) -> None:
        if not self.allocated:
            self.payload.untyped_storage().resize_(self.chunk_size * self.payload.element_size())
            self.allocated = True

    def gather(self, async_op: bool, side_stream=None) -> Handle:
        """Starts gathering the current weights into the payload (allocating it if needed).

        Args:
            async_op: return before the gather completes (``Handle.wait()`` completes it).
            side_stream: a stream (``self.ops``'s) for prefetches: the host-to-device copy, the cast
                and the collective are ordered on it, and waiting makes the current stream wait for it.
        """
        self.allocate()  # on the current stream: the payload's memory belongs to the compute stream
        if side_stream is None:
            return self._gather_on_current_stream(async_op)
        ops = self.ops
        ops.wait_stream(side_stream, ops.current_stream())  # the shard's last update, the payload's last reader
        with ops.use_stream(side_stream):
            handle = self._gather_on_current_stream(async_op=True)
            event = ops.record_event(side_stream)

        def wait() -> None:
            handle.wait()
            ops.wait_event(ops.current_stream(), event)  # the payload is read (or freed) after this

        return Handle(None, wait)

    def _gather_on_current_stream(self, async_op: bool) -> Handle:
        # In place, as FSDP does: this rank's part of the payload is written from the shard (the
        # compute-dtype upload copy of a host shard crosses the link; a device shard is cast), then
        # gathered around it; no temporary. Writes go through .data (a fresh version counter):
        # gathering must not look like an in-place change to the tensors autograd saved.
        raw = self.payload.data
        mine = raw[self.shard_begin : self.shard_begin + self.shard_numel]
        if self.offload:
            assert self.upload is not None  # an offloaded chunk always has its upload copy
            mine.copy_(self.upload, non_blocking=True)
            if self.ops.streams:  # the copy reads ``upload`` after we return: writes wait for it
                self.upload_event = self.ops.record_event()
        else:
            mine.copy_(self.master)
        if self.comm.world_size == 1:
            return DONE
        return self.comm.all_gather_into_tensor(raw, mine, async_op=async_op)

    def bind(self) -> None:
        """Points the parameters at their views of the gathered payload."""
        raw = self.payload.data
        for slot in self.slots:
            set_local_data(slot.param, raw[slot.offset : slot.offset + slot.numel].view(slot.shape))
            slot.state = transition(slot.state, "gather")
        self.fresh = True

    def unbind(self, placeholder: torch.Tensor) -> None:
        """Detaches the parameters from the payload (they keep their shape, read as NaN)."""
        for slot in self.slots:
            set_local_data(slot.param, placeholder.expand(slot.shape))
            slot.state = transition(slot.state, "release")
        self.fresh = False

    def free(self) -> None:
        self.payload.untyped_storage().resize_(0)
        self.allocated = False

    def in_use(self) -> bool:
        return any(slot.state is TensorState.COMPUTE for slot in self.slots)

    def awaiting_grads(self) -> bool:
        """Some module's backward may still read this chunk (evict only when nothing else can go)."""
        return any(slot.awaiting_grad for slot in self.slots)

    def payload_bytes(self) -> int:
        return self.payload.untyped_storage().nbytes()

    # --- gradients -----------------------------------------------------------------------------

    def reduce_ready(self) -> bool:
        """Every parameter's gradient of this backward has arrived (the rest is staged or reduced)."""
        return not self.frozen and self.received == len(self.slots) and self.staging is not None

    def start_reduce(self, drain: GradDrain) -> None:
        """Starts the reduce-scatter of the staged gradients (missing ones count as zero).

        Args:
            drain: moves the reduced shard of an offloaded chunk to the host, overlapped.
        """
        buffer = self.staging
        assert buffer is not None, "start_reduce before any gradient was staged (see reduce_ready)"
        assert self.pending is None, "start_reduce with a reduction in flight (finish_reduce it first)"
        self.staging = None
        self.staged = 0
        for slot in self.slots:
            if slot.state in GRAD_STAGED:
                slot.state = transition(slot.state, "reduced")
        world = self.comm.world_size
        divisor = world if self.grad_divisor is None else self.grad_divisor
        reduced = buffer
        if self.grad_divisor is not None:  # an expert chunk: its shard is cut for its own group
            out = buffer.full[: self.shard_numel] if world == 1 else buffer.full.new_empty(self.shard_numel)
            reduced = StagingBuffer(buffer.full, out, self.landing)
        handle = DONE
        if divisor > 1:
            buffer.full.div_(divisor)  # average over ranks (gloo has no AVG)
        if world > 1:
            handle = self.comm.reduce_scatter_tensor(reduced.out, buffer.full, async_op=True)
        if self.offload:
            self.pending = (buffer, drain.submit(handle, reduced, self.grad), reduced.out)
        else:
            self.pending = (buffer, handle, reduced.out)

    def finish_reduce(self) -> StagingBuffer:
        """Waits for the reduction in flight; its result is then in the fp32 shard gradient.

        Returns:
            The staging buffer, free to reuse.
        """
        assert self.pending is not None, "finish_reduce without a reduction in flight (see start_reduce)"
        buffer, waitable, out = self.pending
        self.pending = None
        if isinstance(waitable, Future):
            waitable.result()  # copied down and added on the host by the drain
        else:
            waitable.wait()
            self.grad.add_(out)
        return buffer

    # --- accounting ----------------------------------------------------------------------------

    def shard_bytes(self) -> int:
        return self.master.nbytes + self.grad.nbytes
