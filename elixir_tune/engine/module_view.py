"""The user's own module after ``setup``: what DDP scripts call on ``model.module`` keeps working.

DDP scripts keep ``raw_model = model.module`` and call ``raw_model.state_dict()`` to save (nanoGPT
does, on rank 0 alone). Under the engine that module's chunked parameters hold a placeholder
(NaN) whenever their chunk is released, so torch's own ``state_dict`` would write NaN into the
checkpoint. The module's ``state_dict``, ``load_state_dict``, ``zero_grad`` and ``save_pretrained`` are
therefore the wrapper's: full weights gathered from and written into the shards, gradients cleared in
the shards, and ``save_pretrained`` writing the weights gathered to rank 0.
"""

from __future__ import annotations

from typing import Any

import torch


def stand_in_for_module(module: torch.nn.Module, wrapper: Any) -> None:
    """Gives ``module`` (wrapped by the ElixirModel ``wrapper``) the wrapper's weight and gradient calls.

    ``state_dict(keep_vars=True)`` stays torch's (the live tensors: the engine reads its own module
    that way); the default call returns the gathered full weights, as ``wrapper.state_dict`` does.
    """

    def state_dict(*args: Any, destination=None, prefix: str = "", keep_vars: bool = False, **kwargs: Any):
        if keep_vars or args:
            return torch.nn.Module.state_dict(
                module, *args, destination=destination, prefix=prefix, keep_vars=keep_vars, **kwargs
            )
        return wrapper.state_dict(destination=destination, prefix=prefix)

    module.state_dict = state_dict  # type: ignore[method-assign]
    module.load_state_dict = wrapper.load_state_dict  # type: ignore[method-assign]  # into the shards
    module.zero_grad = wrapper.zero_grad  # type: ignore[method-assign]
    save = getattr(module, "save_pretrained", None)
    if callable(save):

        def save_pretrained(save_directory: Any, *args: Any, state_dict=None, **kwargs: Any):
            if state_dict is None:
                # The whole weights, gathered to rank 0 (Trainer saves there alone; the others serve it).
                # Called on every rank, rank 0 writes and the others, holding nothing, write nothing.
                state_dict = wrapper.state_dict()
                if not state_dict:
                    return None
            return save(save_directory, *args, state_dict=state_dict, **kwargs)

        module.save_pretrained = save_pretrained  # type: ignore[assignment]
