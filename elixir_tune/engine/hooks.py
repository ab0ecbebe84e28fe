"""Hooks that drive the engine from the model's own forward and backward.

* forward pre-hook on every module that owns chunked parameters directly: gather its chunks;
* forward hook: mark them idle, and hook the outputs so that the module's backward gathers them
  again first (a pre-backward hook: it fires when the gradient of the output is ready, before
  the module's own backward ops run);
* post-accumulate-grad hook on every chunked parameter: stage its gradient in the chunk;
* activation checkpointing: the plan's blocks run under torch.utils.checkpoint (non-reentrant),
  fully or with torchtitan's per-op policy (selective), and their recomputation in backward goes
  through the same forward hooks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import checkpoint as torch_checkpoint

from elixir_tune.selective_checkpoint import selective_context


def output_tensors(output: Any) -> list[torch.Tensor]:
    """Tensors in a module output (tensors, tuples, lists, dicts, HF ModelOutput) that need grad."""
    found: list[torch.Tensor] = []
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad and item.grad_fn is not None:
                found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        elif isinstance(item, types.SimpleNamespace):
            stack.extend(vars(item).values())
    return found


def install_module_hooks(
    modules: dict[torch.nn.Module, str], pre_forward: Callable, post_forward: Callable, pre_backward: Callable
) -> list:
    """Registers the forward and pre-backward hooks.

    Args:
        modules: module -> its qualified name, for every module owning chunked parameters.
        pre_forward: called as ``pre_forward(module)``.
        post_forward: called as ``post_forward(module)``.
        pre_backward: called as ``pre_backward(module)`` (possibly several times per backward).

    Returns:
        The hook handles.
    """
    handles = []
    for module in modules:

        def pre_hook(mod, args):
            pre_forward(mod)

        def post_hook(mod, args, output):
            post_forward(mod)
            if torch.is_grad_enabled():
                for tensor in output_tensors(output):
                    tensor.register_hook(lambda grad, mod=mod: pre_backward(mod))

        handles.append(module.register_forward_pre_hook(pre_hook))
        handles.append(module.register_forward_hook(post_hook))
    return handles


def install_grad_hooks(params: list[torch.nn.Parameter], on_grad: Callable) -> list:
    """Registers ``on_grad(param)`` to run once a parameter's gradient for this backward is complete.

    A bound method is held weakly: a tensor's hooks are referenced from C++, where the garbage
    collector cannot see them, so a strong reference would keep the engine (and every buffer it
    holds) alive after the model is dropped.
    """
    hook = weak_method(on_grad) if isinstance(on_grad, types.MethodType) else on_grad
    return [param.register_post_accumulate_grad_hook(hook) for param in params]


def weak_method(method: types.MethodType) -> Callable:
    """A callable that calls ``method`` while its object is alive (and does nothing after)."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        target = ref()
        if target is not None:
            return target(*args, **kwargs)
        return None

    return call


def _no_early_stop():
    # Early stopping ends a recomputation halfway (by an internal exception), which would skip the
    # forward hooks of the modules after the stop; recompute whole blocks instead.
    setter = getattr(torch_checkpoint, "set_checkpoint_early_stop", None)
    return setter(False) if setter is not None else contextlib.nullcontext()


def wrap_checkpointed(block: torch.nn.Module, selective: bool = False) -> None:
    """Makes ``block`` run its forward under non-reentrant activation checkpointing.

    Args:
        block: the block.
        selective: keep what torchtitan's per-op policy saves (``elixir_tune.selective_checkpoint``)
            instead of the block's input only. The recomputation runs the whole forward either way
            (a saved op returns its kept output instead of running), so the module hooks gather the
            block's chunks for it as for a full recomputation.
    """
    inner = block.forward
    context = {"context_fn": selective_context} if selective else {}

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        with _no_early_stop():
            return torch_checkpoint.checkpoint(inner, *args, use_reentrant=False, **context, **kwargs)

    block.forward = forward
