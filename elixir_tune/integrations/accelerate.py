"""accelerate's ``Accelerator.prepare`` on the chunk engine: how Trainer and accelerate scripts run a plan.

transformers' ``Trainer`` hands its model and optimizer to ``accelerator.prepare``, as a plain
accelerate loop does (and TRL's trainers, Trainer's subclasses, whose fused LM head is refused:
``refuse_patched_head``). Under elixir-run that call would wrap the
model in DistributedDataParallel and ignore the plan. So in each worker, once accelerate is imported,
``prepare`` is replaced by ``prepare_with_plan``:

* the model and its optimizer go through ``elixir_tune.setup`` (the plan of ``$ELIXIR_TUNE_PLAN``):
  the model comes back as the ``ElixirModel``, never wrapped in DDP;
* every other object (the sharded optimizer, data loaders, schedulers) goes through accelerate's own
  ``prepare`` as usual: its loaders still shard the data by rank, its ``AcceleratedOptimizer``
  still steps only at the end of each accumulation.

What accelerate then calls works on the engine: ``accumulate`` (``model.no_sync``), ``backward``,
``clip_grad_norm_`` (replaced too: the engine's global clip), ``unwrap_model`` (the ``ElixirModel``,
whose ``state_dict`` gathers), ``wait_for_everyone`` and ``save_model``. A model prepared without its
optimizer, or two models, cannot be set up and are refused with what to do.
"""

from __future__ import annotations

from typing import Any

import torch

from elixir_tune.engine import grad_view
from elixir_tune.engine.model import ElixirModel

# The name of the forward TRL puts on a model for its fused LM head (trl/trainer/utils.py add_fused_lm_head).
TRL_FUSED_FORWARD = "_fused_forward"


class PrepareError(RuntimeError):
    """An ``accelerator.prepare`` call the plan cannot run."""


def prepare_with_plan(original: Any) -> Any:
    """``Accelerator.prepare`` that sets the model and its optimizer up on the plan first.

    Args:
        original: accelerate's own ``Accelerator.prepare``.
    """

    def prepare(self: Any, *args: Any, device_placement: list[bool] | None = None) -> Any:
        set_up = [i for i, obj in enumerate(args) if isinstance(obj, ElixirModel)]
        if set_up:  # the script called elixir_tune.setup itself: the model stays as it is, never wrapped
            return _prepare_around(self, original, args, set_up[0], device_placement)
        models = [i for i, obj in enumerate(args) if isinstance(obj, torch.nn.Module)]
        optimizers = [i for i, obj in enumerate(args) if isinstance(obj, torch.optim.Optimizer)]
        if not models:  # nothing to set up: loaders, schedulers
            return original(self, *args, device_placement=device_placement)
        if len(models) > 1 or len(optimizers) != 1:
            raise PrepareError(
                f"accelerator.prepare got {len(models)} model(s) and {len(optimizers)} optimizer(s); under elixir-run "
                "one model is set up on the plan together with its optimizer: prepare them in one call, "
                "accelerator.prepare(model, optimizer, ...)"
            )
        import elixir_tune

        refuse_patched_head(args[models[0]])
        model, optimizer = elixir_tune.setup(args[models[0]], args[optimizers[0]])
        objects = list(args)
        objects[models[0]], objects[optimizers[0]] = model, optimizer
        return _prepare_around(self, original, tuple(objects), models[0], device_placement)

    prepare.__wrapped__ = original  # type: ignore[attr-defined]
    return prepare


def refuse_patched_head(model: torch.nn.Module) -> None:
    """Refuses a model whose forward TRL replaced with its fused LM head (``add_fused_lm_head``).

    That forward reads the output head's weight and projects through it in tiles, never calling the
    head module, so the engine would not gather the head's chunk for it. Recorded as a read of the
    model itself (``model.foreign_reads``) it runs, but its first losses differed from DDP's by up to
    8e-6 relative for reasons not yet found: refused until they match.

    Raises:
        PrepareError: the model carries TRL's fused forward.
    """
    patched = model.__dict__.get("forward")
    code = getattr(getattr(patched, "__func__", None), "__code__", None)
    if code is not None and code.co_name == TRL_FUSED_FORWARD:
        raise PrepareError(
            "this model's forward is TRL's fused LM head (SFTTrainer and other TRL trainers patch it in), which "
            "elixir-run does not run yet: it reads lm_head.weight outside lm_head's forward. Train with "
            "transformers.Trainer under elixir-run, or run the TRL script under torchrun"
        )


def _prepare_around(
    accelerator: Any,
    original: Any,
    args: tuple,
    model_index: int,
    device_placement: list[bool] | None,
) -> Any:
    """accelerate's own ``prepare`` of every object but the set-up model, which keeps its place unwrapped."""
    rest = [i for i in range(len(args)) if i != model_index]
    optimizers = [i for i in rest if isinstance(args[i], torch.optim.Optimizer)]
    # The sharded optimizer keeps its state where the plan put it: accelerate must not move it.
    asked: list[bool | None] = list(device_placement) if device_placement else [None] * len(args)
    placement = [False if i in optimizers else asked[i] for i in rest]
    placement = [accelerator.device_placement if flag is None else flag for flag in placement]
    prepared = original(accelerator, *(args[i] for i in rest), device_placement=placement) if rest else ()
    prepared = prepared if isinstance(prepared, tuple) else (prepared,)
    result = list(args)
    for index, obj in zip(rest, prepared, strict=True):
        result[index] = obj
    return result[0] if len(result) == 1 else tuple(result)


def clip_on_plan(original: Any) -> Any:
    """``Accelerator.clip_grad_norm_`` that clips a set-up model as torch's clip does under the engine
    (the global norm over every shard); accelerate's own computes norms of each ``p.grad``, which
    holds a placeholder there."""

    def clip_grad_norm_(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(grad_view.is_sharded(param) for param in params):
            return grad_view.clip_grad_norm_(params, max_norm, norm_type)
        return original(self, params, max_norm, norm_type)

    clip_grad_norm_.__wrapped__ = original  # type: ignore[attr-defined]
    return clip_grad_norm_


def install(module: Any) -> None:
    """Replaces ``Accelerator.prepare`` and ``clip_grad_norm_`` in the just-loaded ``accelerate.accelerator``."""
    accelerator = module.Accelerator
    if not hasattr(accelerator.prepare, "__wrapped__"):
        accelerator.prepare = prepare_with_plan(accelerator.prepare)
        accelerator.clip_grad_norm_ = clip_on_plan(accelerator.clip_grad_norm_)
