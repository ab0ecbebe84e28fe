"""Where a model's forward puts its loss, for the profiler and for ``forward_backward``.

Models return their loss in one of a few shapes: a scalar tensor, an object with ``.loss``
(transformers' ModelOutput), a mapping with ``"loss"``, or a tuple such as nanoGPT's
``(logits, loss)``. A tuple is read only when exactly one of its items is a one-element tensor that
requires grad: with two such items which one is the loss is ambiguous, and the caller says so.
"""

from __future__ import annotations

from typing import Any

import torch


def find_loss(output: Any) -> Any:
    """The loss in a forward's output, or what stands where it should be (None when there is none).

    Args:
        output: what ``model(**batch)`` returned.

    Returns:
        The loss tensor; otherwise the ``loss`` attribute or item found (possibly None or not a
        tensor), for the caller's error message.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output.get("loss")
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)):
        scalars = [
            item for item in output if isinstance(item, torch.Tensor) and item.numel() == 1 and item.requires_grad
        ]
        if len(scalars) == 1:
            return scalars[0]
    return loss
