"""The life of a micro-batch in the engine: what its module hooks do in forward and backward.

A part of ``Engine`` (engine.py), whose hooks (``hooks.py``) call these methods:
    forward   a module's pre-hook fetches its chunks through the cache (all-gather) and marks them in
              use, its post-hook marks them idle; a layered step hands over to the other
              micro-batches at each layer boundary (``layered.py``);
    backward  a module's output hook (``pre_backward``) fetches its chunks again, with those of its
              ancestors that own parameters, and pins them (a checkpointed block's are gathered by
              its recomputation instead); an autograd callback (``end_backward``) queued on the
              first one reduces what is left (``grad_path.py``) and unpins every chunk.
A backward stopped by an exception never runs its callback: the next forward drops what it staged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from elixir_tune.engine.chunks.states import GRAD_STAGED, TensorState, transition
from elixir_tune.engine.read_guard import ReadGuard
from elixir_tune.engine.uneven import EVAL, POST, PRE, TRAIN, ForwardAgreement

if TYPE_CHECKING:
    from elixir_tune.engine.chunks.cache import ChunkCache
    from elixir_tune.engine.chunks.chunk import Chunk, ParamSlot
    from elixir_tune.engine.grad_path import GradPath
    from elixir_tune.engine.layered import Baton
    from elixir_tune.engine.module_map import ModuleMap


class ModulePasses:
    """Forward and backward hooks' work of an ``Engine``.

    Args:
        cache: the engine's chunk cache.
        chunks: the engine's chunks.
        slots: every chunked parameter's slot, in chunk order.
        module_map: which module reads which chunks (module_map.py).
        checkpointed_block: module -> its checkpointed block (the engine fills it as it wraps blocks).
        nan: the placeholder the parameters of chunks not gathered point at.
        grads: the engine's gradient path (staging and reductions).
        check_scaled: called at the end of each backward (the engine's fp16 loss-scale check).
    """

    def __init__(
        self,
        *,
        cache: ChunkCache,
        chunks: list[Chunk],
        slots: list[ParamSlot],
        module_map: ModuleMap,
        checkpointed_block: dict[torch.nn.Module, torch.nn.Module],
        nan: torch.Tensor,
        grads: GradPath,
        check_scaled: Callable[[], None],
    ):
        self.cache = cache
        self.chunks = chunks
        self.slots = slots
        self.module_map = module_map
        self._checkpointed_block = checkpointed_block
        self._nan = nan
        self.grads = grads
        self._check_scaled = check_scaled
        # Set by setup where a forward has collectives and ranks may run forwards alone (uneven.py).
        self.agreement: ForwardAgreement | None = None
        self.baton: Baton | None = None  # set while a layered step's forwards run (engine/layered.py)
        self._running: dict[torch.nn.Module, int] = {}  # forwards inside each module (several when layered)
        self._recomputed: set[torch.nn.Module] = set()  # checkpointed blocks recomputed in this backward
        self._callback_queued = False
        self._bwd_module: torch.nn.Module | None = None
        self._bwd_pins: list[torch.nn.Module] = []
        self.in_backward = False
        self.backward_passes = 0
        self.wrapper_depth = 0  # forwards the wrapper runs now; 0 while a forward goes around it

    @contextlib.contextmanager
    def through_wrapper(self) -> Iterator[None]:
        """The model wrapper's forwards (``ElixirModel``): they call ``begin_forward`` themselves."""
        self.wrapper_depth += 1
        try:
            yield
        finally:
            self.wrapper_depth -= 1

    def root_pre_forward(self) -> None:
        """The user's model starts a forward. One that went around the wrapper (the module object kept
        from before setup, ``model.module(x)``, minGPT's ``generate``) begins as the wrapper's would:
        a rank that runs it alone leads and the others serve it, instead of a gather that hangs."""
        if self.wrapper_depth == 0:
            self.begin_forward()

    # --- forward -------------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """Called by the model wrapper before each forward (one micro-batch)."""
        if self.in_backward:
            self._abandon_backward()
        if self.agreement is not None:  # ranks that evaluate alone lead, the others follow (uneven.py)
            self.agreement.enter(TRAIN if torch.is_grad_enabled() else EVAL)
        self.start_microbatch()

    def start_microbatch(self) -> None:
        """The engine's side of a new forward (also what a follower replays for its leader)."""
        self._running.clear()  # a forward stopped by an exception never ran its post-hooks
        self.cache.start_microbatch()
        if self.grads.grad_placeholders is not None:  # autograd must find no p.grad to add to
            self.grads.grad_placeholders.hide()

    def _abandon_backward(self) -> None:
        """A backward stopped by an exception never ran its end callback: drop what it staged."""
        self.grads.drop_staged()
        for chunk in self.chunks:
            chunk.received = 0
            for slot in chunk.slots:
                slot.awaiting_grad = False
                slot.state = transition(slot.state, "reduced")
        self.cache.wait_all()
        self._bwd_module, self._bwd_pins = None, []
        self._recomputed.clear()
        self._callback_queued = self.in_backward = False

    def read_check(self) -> contextlib.AbstractContextManager:
        """The context of a forward: until the first backward has completed, a ``ReadGuard`` that
        raises when an operation reads a chunked parameter the engine did not gather (read_guard.py);
        afterwards nothing."""
        if self.backward_passes:
            return contextlib.nullcontext()
        return ReadGuard(self.slots, self._nan, self._running_names)

    def _running_names(self) -> list[str]:
        """Names of the hooked modules running now, outermost first."""
        running = [self.module_map.names[m] for m, count in self._running.items() if count > 0]
        return sorted(running, key=lambda name: (name.count("."), name))

    def layer_boundary(self) -> None:
        """Layered step: the other micro-batches run up to here first (engine/layered.py)."""
        if self.baton is not None:
            self.baton.boundary()

    def pre_forward(self, module: torch.nn.Module) -> None:
        if self.agreement is not None and self.agreement.leading:
            self.agreement.announce(PRE, self.module_map.index[module])
        if module not in self._checkpointed_block:
            # Not inside a checkpointed block: those yield once, before their checkpoint saves the
            # RNG state (a pre-hook on the block), so that the recomputation, which runs alone,
            # draws the same random numbers (dropout) as the forward did.
            self.layer_boundary()
        self._running[module] = self._running.get(module, 0) + 1
        if self.in_backward and module in self._checkpointed_block:
            self._recomputed.add(self._checkpointed_block[module])
        if self.in_backward and self._bwd_module is not None:
            # A recomputation: the module waiting for it need not hold its chunks meanwhile (its
            # own recomputed forward, which comes last, gathers them again and pins them).
            self._set_state(self._bwd_module, "done")
        self.cache.fetch(self.module_map.chunks[module], self.module_map.names[module])
        self._set_state(module, "use")

    def post_forward(self, module: torch.nn.Module) -> None:
        if self.agreement is not None and self.agreement.leading:
            self.agreement.announce(POST, self.module_map.index[module])
        self._running[module] -= 1
        if self._running[module] > 0:
            return  # layered: another micro-batch is still inside this module (an ancestor of the others)
        self._set_state(module, "done")
        for ancestor in self.module_map.sharing_ancestors.get(module, ()):
            if self._running.get(ancestor):
                self._set_state(ancestor, "use")
        if self.in_backward and module is self._bwd_module:
            self._set_state(module, "use")

    def _set_state(self, module: torch.nn.Module, event: str) -> None:
        for slot in self.module_map.slots[module]:
            slot.state = transition(slot.state, event)

    # --- backward ------------------------------------------------------------------------------

    def queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def on_grad(self, param: torch.nn.Parameter) -> None:
        """A parameter's post-accumulate-grad hook: queues the end of backward, stages the gradient."""
        self.queue_end_of_backward()
        self.grads.on_grad(param)

    def pre_backward(self, module: torch.nn.Module) -> None:
        # Pin the module and its ancestors that own parameters: the ancestors' own ops around
        # this module may need their weights in backward too.
        self.queue_end_of_backward()
        if module in self._bwd_pins:
            return  # an ancestor whose output hook fires after its child's: already pinned and gathered
        pins = [module] + self.module_map.ancestors.get(module, [])
        for old in self._bwd_pins:
            self._set_state(old, "done")
        self._bwd_pins = pins
        self._bwd_module = module
        block = self._checkpointed_block.get(module)
        if (
            block is not None
            and block not in self._recomputed
            and all(self._checkpointed_block.get(a) is not block for a in pins[1:])
        ):
            # The module's backward first recomputes its checkpointed block, whose forward hooks
            # gather the module's chunks again (and pin them, it comes last): gathering them now
            # would be a wasted fetch (the cost model's trace has none). Ancestors outside the
            # block still get theirs.
            pins = pins[1:]
            chunks = list(dict.fromkeys(c for a in pins for c in self.module_map.chunks[a]))
            if chunks:
                self.cache.fetch(chunks, self.module_map.names[module])
        else:
            self.cache.fetch(self.module_map.chain_chunks(module), self.module_map.names[module])
        for pinned in pins:
            self._set_state(pinned, "use")
        for slot in self.module_map.slots[module]:
            if slot.state not in GRAD_STAGED and not slot.chunk.frozen:
                slot.awaiting_grad = True

    def end_backward(self) -> None:
        """The autograd callback after each backward: reduces what is left and unpins the chunks."""
        self._check_scaled()
        self.grads.reduce_rest()
        for slot in self.slots:
            slot.awaiting_grad = False
            if slot.state is TensorState.COMPUTE:
                slot.state = transition(slot.state, "done")
        self.cache.wait_all()
        self.cache.finish_recording()
        self._bwd_module = None
        self._bwd_pins = []
        self._recomputed.clear()
        self._callback_queued = False
        self.in_backward = False
        self.backward_passes += 1
        if (
            self.grads.grad_placeholders is not None and self.grads.grad_passes == 1
        ):  # torch code reading p.grad meets one
            self.grads.grad_placeholders.show()
