"""What PyTorch code sees of the gradients, which live in the engine's shards.

After ``setup`` no trainable parameter keeps its gradient in ``p.grad``: each rank holds its shard
of each chunk's gradient. Training scripts read ``p.grad`` all the same: torch's
``clip_grad_norm_``, gradient logging, ``p.grad is None`` checks. Left at None, every one of them
would do nothing without a word (clipping 0 gradients, logging a norm of 0). So:

* torch's ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` (looked up by attribute, as
  scripts call them) send the engine's parameters to their optimizer's global clip over every shard
  of every rank, and any other parameters to torch's own functions (``install``);
* between a backward and the next forward, each trainable parameter's ``p.grad`` is a
  ``ShardedGrad``: it has the parameter's shape, dtype and device, so ``p.grad is None`` checks and
  metadata work, but any computation on it (a norm, a copy, a clip bound before ``setup``) raises
  ``GradientInShardsError`` saying what to call instead. It is removed before the next forward, so
  autograd never accumulates into it, and by ``zero_grad``, as torch sets gradients to None.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any

import torch


class GradientInShardsError(RuntimeError):
    """Code computed with ``p.grad`` of a parameter whose gradient lives in the engine's shards."""


_ADVICE = (
    "under elixir-tune each rank holds only its shard of the gradients, so p.grad holds a placeholder; clip with "
    "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) (looked up as an attribute of "
    "torch.nn.utils, not imported before elixir_tune.setup) or optimizer.clip_grad_norm(max_norm), which return "
    "the global norm; optimizer.grad_norm() gives the norm without clipping"
)


_ZEROS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # the element each placeholder expands


class ShardedGrad(torch.Tensor):
    """Stands in ``p.grad`` of a sharded parameter: metadata only, any computation raises.

    It views one shared zero element expanded to the parameter's shape, so code that only inspects
    storages (a memory profiler) finds a real one of a few bytes.
    """

    @staticmethod
    def __new__(cls, param: torch.Tensor) -> ShardedGrad:
        key = (param.dtype, param.device)
        if key not in _ZEROS:
            _ZEROS[key] = torch.zeros((), dtype=param.dtype, device=param.device)  # 0-dim: expands to any shape
        return torch.Tensor._make_subclass(cls, _ZEROS[key].expand(param.shape), False)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise GradientInShardsError(f"{func} on p.grad: {_ADVICE}")

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # torch's would compute
        return f"ShardedGrad(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


class GradPlaceholders:
    """The placeholders of a model's trainable parameters, made once, and whether they are shown.

    Args:
        params: the trainable (chunked) parameters.
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        self._pairs = [(param, ShardedGrad(param)) for param in params]
        self._shown = False

    def show(self) -> None:
        """After a backward: each parameter without a gradient gets its placeholder (one held for
        no-sync stays)."""
        for param, placeholder in self._pairs:
            if param.grad is None:
                param.grad = placeholder
        self._shown = True

    def hide(self) -> None:
        """Before a forward and at ``zero_grad``: autograd must find no gradient to add to, and torch
        code sees None, as after torch's ``zero_grad``."""
        if not self._shown:
            return
        for param, placeholder in self._pairs:
            if param.grad is placeholder:
                param.grad = None
        self._shown = False


# --- torch's clipping functions ----------------------------------------------------------------

# id(parameter) -> (the parameter, the ShardedOptimizer that steps it), both weakly: an id may be reused
_OWNER: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_TORCH_CLIP_NORM = torch.nn.utils.clip_grad_norm_
_TORCH_CLIP_VALUE = torch.nn.utils.clip_grad_value_


def register(optimizer: Any, params: Iterable[torch.nn.Parameter]) -> None:
    """Routes torch's clipping of ``params`` to ``optimizer`` (a ShardedOptimizer)."""
    reference = weakref.ref(optimizer)
    for param in params:
        _OWNER[id(param)] = (weakref.ref(param), reference)
    install()


def _owner(param: torch.Tensor) -> Any:
    entry = _OWNER.get(id(param))
    return entry[1]() if entry is not None and entry[0]() is param else None


def is_sharded(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient lives in a ShardedOptimizer's shards (torch's clipping goes there)."""
    return _owner(param) is not None


def _owner_of(parameters: Any, function: str) -> tuple[Any, list[torch.Tensor]]:
    """The ShardedOptimizer that owns ``parameters`` (None: none of them is sharded), and the list."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owned = [p for p in params if _owner(p) is not None]
    owners = {id(o): o for o in map(_owner, owned)}
    if not owners:
        return None, params
    others = [p for p in params if _owner(p) is None and p.grad is not None]
    if len(owners) > 1 or others:
        raise ValueError(
            f"torch.nn.utils.{function} got parameters of a model set up by elixir-tune together with "
            f"{'another set-up model' if len(owners) > 1 else 'parameters with their own gradients'}; clip each "
            "model's parameters in a call of their own"
        )
    owner = next(iter(owners.values()))
    given = {id(p) for p in owned}
    if len(given) < owner.trainable_params:
        raise ValueError(
            f"torch.nn.utils.{function} got {len(given)} of the model's {owner.trainable_params} trainable "
            "parameters; elixir-tune clips all of them together (the global norm over every shard of every rank): "
            "pass model.parameters(), or call optimizer.clip_grad_norm(max_norm)"
        )
    return owner, params


def clip_grad_norm_(
    parameters: Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, for sharded parameters too (the global norm, every rank)."""
    owner, params = _owner_of(parameters, "clip_grad_norm_")
    if owner is None:
        return _TORCH_CLIP_NORM(params, max_norm, norm_type, error_if_nonfinite, foreach)
    norm = owner.clip_grad_norm(max_norm, float(norm_type))
    if error_if_nonfinite and not math.isfinite(float(norm)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )
    return norm


def clip_grad_value_(parameters: Any, clip_value: float, foreach: bool | None = None) -> None:
    """torch.nn.utils.clip_grad_value_, for sharded parameters too."""
    owner, params = _owner_of(parameters, "clip_grad_value_")
    if owner is None:
        _TORCH_CLIP_VALUE(params, clip_value, foreach)
    else:
        owner.clip_grad_value(float(clip_value))


def install() -> None:
    """Puts the functions above where scripts look torch's up (idempotent)."""
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        module.clip_grad_norm_ = clip_grad_norm_  # type: ignore[attr-defined]
        module.clip_grad_value_ = clip_grad_value_  # type: ignore[attr-defined]
