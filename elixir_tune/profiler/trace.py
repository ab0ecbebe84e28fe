"""The parameter access trace: which parameters each module call touches, forward and backward.

Granularity is what the engine hooks: one step per call of a module that owns parameters directly
(``module.parameters(recurse=False)``), at its pre-forward, and one when the gradient of its output
arrives in backward (just before its backward ops run). Forward calls made during backward are
the recomputation of checkpointed blocks.

A module may also read parameters it does not own (a parent reading a child's ``.weight``, a
functional call on a sibling's parameters, as Mamba's mixer does with its ``conv1d`` and
``dt_proj``): every op's parameter arguments are seen by the meter, and a read while none of the
parameter's owners runs is a foreign read of the innermost running module. Its step lists the
parameter as well (the engine gathers it there), and the recorder keeps the pair for the profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from elixir_tune.profiler.meter import LiveMemoryMeter

FORWARD, BACKWARD, RECOMPUTE = "fwd", "bwd", "re"


@dataclass
class Step:
    """One traced step.

    Attributes:
        kind: FORWARD, BACKWARD or RECOMPUTE.
        block: index of the block the module belongs to, or -1.
        params: positions (in the model's unique named_parameters() order) the module owns.
    """

    kind: str
    block: int
    params: tuple[int, ...]


@dataclass
class BlockStats:
    """What one block's first forward did, at the traced batch size.

    Attributes:
        retained_bytes: live bytes its forward added and left for backward (its output included).
        boundary_bytes: bytes of its input hidden states.
        dropout_scores: attention score elements its fused attention computed with dropout
            (``meta_kernels.FusedKernelsOnMeta``: a CPU device runs them on the math path).
        entry_bytes: live activation bytes when its forward began (block 0's: what the modules
            before the blocks left, the embeddings' output among them).
    """

    retained_bytes: int = 0
    boundary_bytes: int = 0
    dropout_scores: int = 0
    entry_bytes: int = 0


@dataclass
class AccessRecorder:
    """Installs the hooks that record steps and block statistics for one pass; remove() after.

    Every module call is followed (a stack of running modules), so that each parameter the meter
    sees an op read is attributed: to a running module that owns it directly (the usual case), or
    else, as a foreign read, to the innermost running module, whose step then lists it too.

    Args:
        model: the model being traced.
        param_pos: id(parameter) -> position in unique named_parameters() order.
        block_modules: the repeated blocks, in order (may be empty).
        meter: the live memory meter of this pass (block attribution is set on it, and it reports
            the parameters each op reads).

    Attributes:
        steps: the recorded steps, in order (steps of modules that touch no parameter are empty).
        blocks: per block, its first forward's statistics.
        foreign: reading module -> positions of trainable parameters it read while none of their
            owners ran (in first-read order).
    """

    model: nn.Module
    param_pos: dict[int, int]
    block_modules: list[nn.Module]
    meter: LiveMemoryMeter
    steps: list[Step] = field(default_factory=list)
    blocks: list[BlockStats] = field(default_factory=list)
    foreign: dict[nn.Module, dict[int, None]] = field(default_factory=dict)
    _handles: list = field(default_factory=list)
    _entry_live_bytes: int = 0
    _running: list[tuple[nn.Module, Step]] = field(default_factory=list)
    _owners: dict[int, set[int]] = field(default_factory=dict)
    _trainable: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.blocks = [BlockStats() for _ in self.block_modules]
        block_of: dict[int, int] = {}
        for index, block in enumerate(self.block_modules):
            for sub in block.modules():
                block_of[id(sub)] = index
            self._handles.append(block.register_forward_pre_hook(self._block_enter(index), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._block_exit(index)))
        for module in self.model.modules():
            owned = tuple(self.param_pos[id(p)] for p in module.parameters(recurse=False))
            for pos, param in zip(owned, module.parameters(recurse=False), strict=True):
                self._owners.setdefault(pos, set()).add(id(module))
                if param.requires_grad:
                    self._trainable.add(pos)
            block_index = block_of.get(id(module), -1)
            self._handles.append(module.register_forward_pre_hook(self._on_forward(block_index, owned)))
            self._handles.append(module.register_forward_hook(self._on_output(block_index)))
        self.meter.param_storages = {p.untyped_storage()._cdata: self.param_pos[id(p)] for p in self.model.parameters()}
        self.meter.on_param_read = self._on_read

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.meter.on_param_read = None

    def _on_forward(self, block: int, owned: tuple[int, ...]):
        def hook(module, args):
            step = Step(RECOMPUTE if self.meter.in_backward else FORWARD, block, owned)
            self.steps.append(step)
            self._running.append((module, step))

        return hook

    def _on_output(self, block: int):
        def hook(module, args, output):
            step = None
            while self._running:  # normally the top; a module left by an exception is dropped too
                running, step = self._running.pop()
                if running is module:
                    break
            if self.meter.in_backward or step is None or not step.params:
                return  # a recomputed output (its graph is only read for saved tensors), or no parameters
            params = step.params  # complete now: its foreign reads are known
            tensors = [t for t in _tensors(output) if t.requires_grad and t.grad_fn is not None]
            fired = [False]

            def on_grad(grad):
                if not fired[0]:
                    fired[0] = True
                    self.steps.append(Step(BACKWARD, block, params))

            for tensor in tensors:
                tensor.register_hook(on_grad)

        return hook

    def _on_read(self, pos: int) -> None:
        """An op read parameter ``pos`` (or a view of it)."""
        if not self._running:
            return  # backward reading a saved view, or code outside the model's forward
        owners = self._owners.get(pos, set())
        if any(id(module) in owners for module, _ in self._running):
            return  # its owner (or an owner of a shared parameter) runs: the engine gathers it there
        reader, step = self._running[-1]
        if pos not in step.params:
            step.params = (*step.params, pos)
        if pos in self._trainable:
            self.foreign.setdefault(reader, {})[pos] = None

    def _block_enter(self, index: int):
        def hook(module, args, kwargs):
            if self.meter.in_backward:
                return
            self.meter.block = index
            self._entry_live_bytes = self.blocks[index].entry_bytes = self.meter.live_bytes
            first = next(iter(_tensors((args, kwargs.get("hidden_states")))), None)
            self.blocks[index].boundary_bytes = first.numel() * first.element_size() if first is not None else 0

        return hook

    def _block_exit(self, index: int):
        def hook(module, args, output):
            if self.meter.in_backward:
                return
            self.meter.block = None
            self.blocks[index].retained_bytes = self.meter.live_bytes - self._entry_live_bytes

        return hook


def ordered_trace(steps: list[Step]) -> list[Step]:
    """Puts each block's recomputation right before that block's backward steps.

    Non-reentrant checkpointing recomputes a block when its first saved tensor is unpacked, which
    is after the gradient of the block's last module has arrived (one backward step early). The
    contract is "recompute, then the block's backward", so the run is moved there.
    """
    out: list[Step] = []
    first_backward_at: dict[int, int] = {}
    i = 0
    while i < len(steps):
        step = steps[i]
        if step.kind == RECOMPUTE and step.block >= 0:
            j = i
            while j < len(steps) and steps[j].kind == RECOMPUTE and steps[j].block == step.block:
                j += 1
            at = first_backward_at.pop(step.block, len(out))
            out[at:at] = steps[i:j]
            i = j
            continue
        if step.kind == BACKWARD and step.block >= 0 and step.block not in first_backward_at:
            first_backward_at[step.block] = len(out)
        out.append(step)
        i += 1
    return out


def _tensors(value) -> list[torch.Tensor]:
    """Tensors in a module output: tensors, tuples, lists, dicts (ModelOutput is a dict)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []
