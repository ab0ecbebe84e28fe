"""The engine's gradient path: staging each parameter's gradient in its chunk and reducing full chunks.

A part of ``Engine`` (engine.py). Each parameter's post-accumulate-grad hook (``on_grad``) copies
its gradient into its chunk's staging buffer, taken from a bounded pool (staging.py); a chunk whose
gradients are all staged starts its reduce-scatter (asynchronous) into the fp32 shard gradient, and
an offloaded chunk's reduced shard drains to the host gradient meanwhile (``GradDrain``). At the end
of backward the chunks left incomplete are reduced in chunk order (``reduce_rest``); the device-side
reductions finish there, host-side ones when the optimizer, the next backward's need for a staging
buffer (``drain_grads``) or the same chunk's next reduction (accumulation) waits for them. No-sync
over several backward passes (a pipeline step's): ``hold_grads`` / ``end_held``.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

from elixir_tune.device import DeviceOps
from elixir_tune.engine.chunks.staging import GradDrain, StagingBuffer, StagingPool
from elixir_tune.engine.chunks.states import transition
from elixir_tune.engine.parallel.tensor_parallel import local_grad

if TYPE_CHECKING:
    from elixir_tune.engine.chunks.chunk import Chunk, ParamSlot
    from elixir_tune.engine.comm import Comm
    from elixir_tune.engine.grad_view import GradPlaceholders
    from elixir_tune.plan import Plan


class GradPath:
    """Gradient staging and reduction of an ``Engine``.

    Args:
        plan: the engine's plan (its staging buffers and chunk size).
        comm: the data-parallel group.
        compute_dtype: the dtype gradients are staged in.
        device: the engine's device.
        ops: the device's streams, events and pinned memory.
        chunks: the engine's chunks.
        slots: every chunked parameter's slot, in chunk order.
        slot_of: id(param) -> its slot.
        landing: some chunks are offloaded: the pool also holds host landing buffers for their shards.
    """

    def __init__(
        self,
        *,
        plan: Plan,
        comm: Comm,
        compute_dtype: torch.dtype,
        device: torch.device,
        ops: DeviceOps,
        chunks: list[Chunk],
        slots: list[ParamSlot],
        slot_of: dict[int, ParamSlot],
        landing: bool,
    ):
        self.chunks = chunks
        self.slots = slots
        self.slot_of = slot_of
        self.reduce_scatters = 0  # chunk reductions started, for tests and benchmarks
        # p.grad placeholders between a backward and the next forward (grad_view.py), set by setup;
        # None: off (a pipeline plan, whose no-sync keeps real gradients in p.grad across passes).
        self.grad_placeholders: GradPlaceholders | None = None
        self.grad_passes = 1  # backward passes per gradient reduction (no-sync: hold_grads)
        self._held: dict[int, int] = {}  # id(slot) -> passes whose gradient is held in param.grad
        # Got a gradient since zero_grad (host); frozen parameters count as used: they never get one.
        self._frozen_slots = torch.tensor([slot.chunk.frozen for slot in self.slots], dtype=torch.bool)
        self.used = self._frozen_slots.clone()
        self._slot_index = {id(slot): i for i, slot in enumerate(self.slots)}
        self.staging = StagingPool(
            plan.memory.staging_buffers,
            plan.memory.chunk_size,
            comm.rank,
            comm.world_size,
            compute_dtype,
            device,
            landing=landing,
            ops=ops,
        )
        self.drain = GradDrain(device, ops)
        self._filling: list[Chunk] = []  # chunks holding a staging buffer, not yet reducing, oldest first
        self._reducing: deque[Chunk] = deque()  # reductions in flight, oldest first

    def _acquire_staging(self) -> StagingBuffer:
        """A free staging buffer; when the pool is empty the oldest reduction in flight is finished
        (or, with none in flight, the chunk that has held its buffer longest is reduced as far as
        its gradients have arrived; the rest follows in a second reduction)."""
        while True:
            buffer = self.staging.acquire()
            if buffer is not None:
                return buffer
            if not self._reducing:
                self._start_reduce(self._filling[0])
            self._finish_oldest()

    def _start_reduce(self, chunk: Chunk) -> None:
        self._filling.remove(chunk)
        if chunk.pending is not None:
            # The chunk's reduction of an earlier backward (an offloaded chunk's, which
            # ``reduce_rest`` leaves draining to the host) is still in flight: a chunk holds one
            # reduction at a time, so that one finishes first (its buffer back to the pool, its
            # shard added to the host gradient) before the next overwrites it.
            self._reducing.remove(chunk)
            self.staging.release(chunk.finish_reduce())
        chunk.start_reduce(self.drain)
        self.reduce_scatters += 1
        self._reducing.append(chunk)

    def _finish_oldest(self) -> None:
        chunk = self._reducing.popleft()
        self.staging.release(chunk.finish_reduce())

    def drain_grads(self) -> None:
        """Completes every reduction in flight (host gradients included): the shard gradients are final."""
        while self._reducing:
            self._finish_oldest()

    def drop_staged(self) -> None:
        """A backward stopped by an exception: finish what it reduces, drop what it staged."""
        self.drain_grads()
        for chunk in self._filling:
            assert chunk.staging is not None  # a filling chunk holds its staging buffer
            self.staging.release(chunk.staging)
            chunk.staging, chunk.staged = None, 0
        self._filling.clear()

    def on_grad(self, param: torch.nn.Parameter) -> None:
        """Stages a parameter's gradient (or holds it under no-sync); ``ModulePasses.on_grad`` calls it."""
        slot = self.slot_of[id(param)]
        if self.grad_passes > 1 and self._hold_grad(slot):
            return
        self._stage_grad(slot, param)

    def _hold_grad(self, slot: ParamSlot) -> bool:
        """No-sync over a step's backward passes (a pipeline's): the gradient stays in ``param.grad``,
        where autograd keeps accumulating it, until the parameter's last pass of the step."""
        held = self._held.get(id(slot), 0) + 1
        if held < self.grad_passes:
            self._held[id(slot)] = held
            return True
        self._held.pop(id(slot), None)
        return False

    def hold_grads(self, passes: int) -> None:
        """Reduce each gradient once per ``passes`` backward passes (``end_held_grads`` ends it)."""
        self.grad_passes = passes

    def end_held(self, flush: bool = True) -> list[ParamSlot]:
        """Ends no-sync. Returns the slots whose gradients are still held (parameters used in fewer
        passes), for ``stage_held`` to stage (``flush``); without ``flush`` (a step that failed) they are
        dropped and none is returned."""
        self.grad_passes = 1
        held = [slot for slot in self.slots if id(slot) in self._held]
        self._held.clear()
        if not flush:
            for slot in held:
                slot.param.grad = None
            return []
        return held

    def stage_held(self, held: list[ParamSlot]) -> None:
        """Stages the gradients ``end_held`` returned, as their post-accumulate-grad hooks would have."""
        for slot in held:
            self._stage_grad(slot, slot.param)

    def _stage_grad(self, slot: ParamSlot, param: torch.nn.Parameter) -> None:
        chunk = slot.chunk
        if chunk.staging is None:
            chunk.staging = self._acquire_staging()
            self._filling.append(chunk)
        assert param.grad is not None  # the post-accumulate-grad hook runs with the gradient set
        grad = local_grad(param, param.grad)
        chunk.staging.full[slot.offset : slot.offset + slot.numel].copy_(grad.reshape(-1))
        param.grad = None
        slot.state = transition(slot.state, "grad")
        slot.awaiting_grad = False
        chunk.staged += 1
        chunk.received += 1
        self.used[self._slot_index[id(slot)]] = True
        if chunk.reduce_ready():
            self._start_reduce(chunk)

    def reduce_rest(self) -> None:
        """End of backward: reduces the chunks left incomplete and finishes the device-side reductions."""
        # Deterministic order on every rank: incomplete chunks in chunk order.
        for chunk in self.chunks:
            if chunk.staging is not None:
                self._start_reduce(chunk)
            chunk.received = 0
        # Device-side reductions finish here; host ones go on draining into the host gradients
        # (the optimizer step or the next backward's need for a buffer waits for them).
        for chunk in [chunk for chunk in self._reducing if not chunk.offload]:
            self._reducing.remove(chunk)
            self.staging.release(chunk.finish_reduce())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the shard gradients after the reductions in flight. ``p.grad`` becomes None, or
        with ``set_to_none=False`` (torch's zero tensors) a placeholder that refuses computation,
        so code that adds to ``p.grad`` is stopped, not given None."""
        self.drain_grads()
        for chunk in self.chunks:
            chunk.grad.zero_()
        self.used.copy_(self._frozen_slots)
        if self.grad_placeholders is not None:
            self.grad_placeholders.hide()
            if not set_to_none:
                self.grad_placeholders.show()
