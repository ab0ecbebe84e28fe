"""Chunks: flat buffers holding whole parameters, sharded over the data-parallel ranks.

A chunk of ``chunk_size`` elements is cut into ``world_size`` equal shards; this rank owns
``[rank * shard, (rank + 1) * shard)``. The shard's fp32 master weights and gradient live on the
device, or in host memory when the chunk is offloaded (the host path always uses its own buffers
and explicit copies, also on a cpu device, so that CI exercises it).

The gathered copy (the "payload", compute dtype, all ``chunk_size`` elements) has a storage of its
own that is allocated when the chunk enters the cache and freed when it leaves (storage resize, as
FSDP does). Keeping one storage per chunk matters: autograd saves views of parameters, and those
views must see the chunk's data again after it is evicted and gathered back in backward or in a
recomputation, whichever cache slot it went through.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elixir_tune.engine.comm import Comm, Handle
from elixir_tune.engine.host_memory import zeros_on_demand
from elixir_tune.engine.states import TensorState, transition


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
    ):
        self.id = chunk_id
        self.chunk_size = chunk_size
        self.comm = comm
        self.compute_dtype = compute_dtype
        self.device = device
        self.resident = resident
        self.offload = offload
        self.shard_numel = chunk_size // comm.world_size
        self.shard_begin = comm.rank * self.shard_numel
        self.slots: list[ParamSlot] = []
        offset = 0
        for index, (name, param) in enumerate(named_params):
            self.slots.append(ParamSlot(name, param, self, index, offset, param.numel(), param.shape))
            offset += param.numel()
        self.numel = offset
        if offset > chunk_size:
            raise ValueError(
                f"chunk {chunk_id}: its parameters hold {offset} elements, more than chunk_size {chunk_size}"
            )

        shard_device = torch.device("cpu") if offload else device
        pin = offload and device.type == "cuda"
        self.master = torch.zeros(self.shard_numel, dtype=torch.float32, device=shard_device, pin_memory=pin)
        if shard_device.type == "cpu" and not pin:  # zero until the first backward: resident from then on
            self.grad = zeros_on_demand(self.shard_numel)
        else:
            self.grad = torch.zeros(self.shard_numel, dtype=torch.float32, device=shard_device, pin_memory=pin)
        self.payload = torch.empty(chunk_size, dtype=compute_dtype, device=device)
        self.payload.untyped_storage().resize_(0)
        self.allocated = False  # payload storage present
        self.fresh = False  # payload holds the current weights
        self.staging: torch.Tensor | None = None  # gradients of this backward, compute dtype
        self.staged = 0  # parameters whose gradient is in ``staging``
        self.pending: tuple[Handle, torch.Tensor, torch.Tensor] | None = None  # reduce in flight

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
            self.master.copy_(full_or_shard_fp32)
            return
        self.master.copy_(full_or_shard_fp32[self.shard_begin : self.shard_begin + self.shard_numel])

    def flat_from_params(self) -> torch.Tensor:
        """The full chunk built from the parameters' current data, fp32, on the device."""
        flat = torch.zeros(self.chunk_size, dtype=torch.float32, device=self.device)
        for slot in self.slots:
            flat[slot.offset : slot.offset + slot.numel].copy_(slot.param.data.reshape(-1))
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
            side_stream: a CUDA stream for prefetches: the host-to-device copy, the cast and the
                collective are ordered on it, and waiting makes the current stream wait for it.
        """
        self.allocate()  # on the current stream: the payload's memory belongs to the compute stream
        if side_stream is None:
            return self._gather_on_current_stream(async_op)
        compute = torch.cuda.current_stream(self.device)
        side_stream.wait_stream(compute)  # the shard's last update and the payload's last reader
        with torch.cuda.stream(side_stream):
            handle = self._gather_on_current_stream(async_op=True)
            event = torch.cuda.Event()
            event.record(side_stream)
        return Handle(None, lambda: (handle.wait(), torch.cuda.current_stream(self.device).wait_event(event)))

    def _gather_on_current_stream(self, async_op: bool) -> Handle:
        shard = self.master
        if self.offload:
            # Host path: copy the host shard into a device buffer first (a real copy, also on cpu).
            shard = torch.empty(self.shard_numel, dtype=torch.float32, device=self.device)
            shard.copy_(self.master, non_blocking=True)
        if shard.dtype != self.compute_dtype:
            shard = shard.to(self.compute_dtype)
        # Writes go through .data (a fresh version counter): gathering must not look like an in-place
        # change to the tensors autograd saved from this chunk.
        return self.comm.all_gather_into_tensor(self.payload.data, shard, async_op=async_op)

    def bind(self) -> None:
        """Points the parameters at their views of the gathered payload."""
        raw = self.payload.data
        for slot in self.slots:
            slot.param.data = raw[slot.offset : slot.offset + slot.numel].view(slot.shape)
            slot.state = transition(slot.state, "gather")
        self.fresh = True

    def unbind(self, placeholder: torch.Tensor) -> None:
        """Detaches the parameters from the payload (they keep their shape, read as NaN)."""
        for slot in self.slots:
            slot.param.data = placeholder.expand(slot.shape)
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
        return self.staged == len(self.slots)

    def start_reduce(self) -> None:
        """Starts the reduce-scatter of the staged gradients (missing ones count as zero)."""
        staging = self.staging
        self.staging = None
        self.staged = 0
        for slot in self.slots:
            slot.state = transition(slot.state, "reduced")
        world = self.comm.world_size
        if world == 1:
            self.pending = (Handle(), staging, staging)
            self.pending[0].done = True
            return
        staging.div_(world)  # average over ranks (gloo has no AVG)
        out = torch.empty(self.shard_numel, dtype=staging.dtype, device=staging.device)
        handle = self.comm.reduce_scatter_tensor(out, staging, async_op=True)
        self.pending = (handle, out, staging)

    def finish_reduce(self) -> torch.Tensor | None:
        """Waits for the reduce in flight and adds it into the fp32 shard gradient.

        Returns:
            The staging buffer, free to reuse (None when nothing was in flight).
        """
        if self.pending is None:
            return None
        handle, out, staging = self.pending
        self.pending = None
        handle.wait()
        if out is staging:
            out = staging[self.shard_begin : self.shard_begin + self.shard_numel]
        if self.offload:
            host = torch.empty(self.shard_numel, dtype=out.dtype, device="cpu", pin_memory=self.device.type == "cuda")
            host.copy_(out)
            out = host
        self.grad.add_(out)
        return staging

    # --- accounting ----------------------------------------------------------------------------

    def shard_bytes(self) -> int:
        return self.master.nbytes + self.grad.nbytes
