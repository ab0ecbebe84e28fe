"""The first step's check that no operation reads a chunked parameter the engine did not gather.

The engine gathers a chunk in the forward pre-hook of the modules that own its parameters and of
the modules the plan's ``model.foreign_reads`` lists as reading them. A read anywhere else (a
module reading another's ``.weight`` that the profile did not record, a training script reading a
weight between steps) finds the parameter released: it points at a one-element NaN placeholder
(expanded to its shape), which reads as NaN, or at a chunk payload that is gathered only by chance.

A released parameter cannot fail on its own without a cost on every step: a payload storage of
zero bytes would, but reading one crashes the process (a segmentation fault in elementwise kernels)
rather than raising. So the model's forwards until the first backward has completed run under
this dispatch mode instead: every operation argument that is a parameter of a non-resident chunk
must be in use by a running module (state COMPUTE), and no argument may be a view of the
placeholder or of a freed payload. A violation raises ``UngatheredRead`` naming the parameter, the
operation and the running modules. Later steps run without it (no cost), on the paths the first
step took.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from elixir_tune.engine.chunks.states import TensorState

if TYPE_CHECKING:
    from elixir_tune.engine.chunks.chunk import ParamSlot


class UngatheredRead(RuntimeError):
    """An operation read a chunked parameter that the engine had not gathered for it."""


class ReadGuard(TorchDispatchMode):
    """Raises ``UngatheredRead`` when an operation reads a chunked parameter that is not in use.

    Args:
        slots: every chunked parameter's slot (resident chunks are never released: not checked).
        placeholder: the tensor released parameters are expanded views of.
        running: names of the hooked modules running now (innermost last), called on a violation.
    """

    def __init__(self, slots: list[ParamSlot], placeholder: torch.Tensor, running) -> None:
        super().__init__()
        self._watched = {id(slot.param): slot for slot in slots if not slot.chunk.resident}
        self._placeholder = placeholder
        self._placeholder_key = placeholder.untyped_storage()._cdata
        self._running = running

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._check(func, (*args, *kwargs.values()))
        return func(*args, **kwargs)

    def _check(self, func, values: tuple) -> None:
        for value in values:
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(item, torch.Tensor):
                    continue
                if item is self._placeholder:
                    return  # the engine releasing parameters (an expanded view of the placeholder)
                slot = self._watched.get(id(item))
                if slot is not None:
                    if slot.state is not TensorState.COMPUTE:
                        self._fail(func, f"parameter {slot.name!r} (chunk {slot.chunk.id})")
                elif type(item) is torch.Tensor and not item.is_meta and item.numel():
                    storage = item.untyped_storage()
                    if storage._cdata == self._placeholder_key or storage.nbytes() == 0:
                        self._fail(func, "a view of a chunked parameter")

    def _fail(self, func, what: str) -> None:
        running = self._running()
        where = f"inside the forward of {running[-1]!r}" if running else "outside every module that owns parameters"
        raise UngatheredRead(
            f"{what} was read by {func} {where} while the engine had not gathered it for that module "
            f"(running: {', '.join(repr(name) for name in running) or 'none'}). The engine gathers a chunk "
            "for the modules that own its parameters and for those the plan's model.foreign_reads lists as "
            "reading them; a released parameter reads as NaN. If a module reads another module's parameter "
            "in its forward, profile and search again (`elixir-tune profile`, `elixir-tune search`) so that "
            "the plan records the read; a read outside every module's forward (the training script, a hook) "
            "cannot be gathered: move it into a module's forward"
        )
