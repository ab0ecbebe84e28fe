"""accelerate's ``Accelerator.prepare`` on the chunk engine: how Trainer and accelerate scripts run a plan.

transformers' ``Trainer`` hands its model and optimizer to ``accelerator.prepare``, as a plain
accelerate loop and TRL's trainers (Trainer's subclasses) do. Under elixir-run that call would wrap
the model in DistributedDataParallel and ignore the plan. So in each worker, once accelerate is
imported, ``prepare`` is replaced by ``prepare_with_plan``:

* the model and its optimizer go through ``elixir_tune.setup`` (the plan of ``$ELIXIR_TUNE_PLAN``):
  the model comes back as the ``ElixirModel``, never wrapped in DDP. TRL's fused LM head
  (``add_fused_lm_head``) reads the output head's weight in the model's own forward, never calling the
  head module: the plan gets that read (``with_fused_head_read``), so the engine gathers the head for it;
* accelerate's mixed precision must be the plan's dtype (``check_precision``): the plan sets the
  precision on the engine, and accelerate's autocast (SFTConfig's default bf16=True) would never reach
  the model, so a mismatch is refused rather than trained in another precision than asked;
* every other object (the sharded optimizer, data loaders, schedulers) goes through accelerate's own
  ``prepare`` as usual: its loaders still shard the data by rank, its ``AcceleratedOptimizer``
  still steps only at the end of each accumulation.

What accelerate then calls works on the engine: ``accumulate`` (``model.no_sync``), ``backward``,
``clip_grad_norm_`` (replaced too: the engine's global clip), ``unwrap_model`` (the ``ElixirModel``,
whose ``state_dict`` gathers), ``wait_for_everyone`` and ``save_model``. A model prepared without its
optimizer, or two models, cannot be set up and are refused with what to do.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from elixir_tune.engine import grad_view
from elixir_tune.engine.model import ElixirModel
from elixir_tune.plan import Plan
from elixir_tune.plan.schema import ForeignRead

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
        from elixir_tune.engine.setup import resolve_plan

        plan = with_fused_head_read(args[models[0]], resolve_plan(None))
        check_engine(plan.engine.name)
        check_precision(getattr(self, "mixed_precision", "no"), plan.training.dtype)
        model, optimizer = elixir_tune.setup(args[models[0]], args[optimizers[0]], plan=plan)
        objects = list(args)
        objects[models[0]], objects[optimizers[0]] = model, optimizer
        return _prepare_around(self, original, tuple(objects), models[0], device_placement)

    prepare.__wrapped__ = original  # type: ignore[attr-defined]
    return prepare


def with_fused_head_read(model: torch.nn.Module, plan: Plan) -> Plan:
    """``plan`` with the model's own read of its output head when TRL's fused LM head is on its forward.

    That forward (``add_fused_lm_head``) projects the backbone's output through the head's weight in
    tiles, never calling the head module, so the profile of the plain model does not show the read: it
    is added as a read of the model itself (``model.foreign_reads``, module ""), and the engine gathers
    the head's chunk around every forward of the model. That chunk then stays gathered beside each
    block's, so the cache gets a block more for it (a warning says how much).

    Returns:
        ``plan`` itself when the forward is the model's own.
    """
    patched = model.__dict__.get("forward")
    code = getattr(getattr(patched, "__func__", None), "__code__", None)
    get_head = getattr(model, "get_output_embeddings", None)  # transformers' models have it
    head = get_head() if callable(get_head) else None
    if code is None or code.co_name != TRL_FUSED_FORWARD or not isinstance(head, torch.nn.Module):
        return plan
    held = {id(param) for param in head.parameters()}
    names = [name for name, param in model.named_parameters() if id(param) in held]
    reads = [*plan.model.foreign_reads, ForeignRead(module="", params=names)]
    # The head's chunks stay gathered through the whole forward now, beside each block's: room for them.
    head_chunks = [c for c in plan.memory.chunks if not c.resident and set(names) & set(c.params)]
    cacheable = sum(1 for c in plan.memory.chunks if not c.resident)
    cache_blocks = min(plan.memory.cache_blocks + len(head_chunks), cacheable)
    if cache_blocks != plan.memory.cache_blocks:
        warnings.warn(
            f"TRL's fused LM head reads {', '.join(names)} through the model's whole forward: the plan's "
            f"chunk cache grows from {plan.memory.cache_blocks} to {cache_blocks} blocks, "
            f"{plan.memory.chunk_size * (cache_blocks - plan.memory.cache_blocks):,} elements more than predicted",
            stacklevel=2,
        )
    return dataclasses.replace(
        plan,
        model=dataclasses.replace(plan.model, foreign_reads=reads),
        memory=dataclasses.replace(plan.memory, cache_blocks=cache_blocks),
    )


def check_engine(name: str) -> None:
    """Refuses a peer plan (FSDP2, DeepSpeed) under accelerate: Trainer would save on rank 0 alone from
    a model sharded by a peer that accelerate does not know of, and lose the model at the end of the run.

    Raises:
        PrepareError: naming the way that works: accelerate's own plugin, configured from the plan.
    """
    if name != "elixir":
        raise PrepareError(
            f"the plan runs engine {name}, which elixir-run does not set up under accelerate (Trainer's final save "
            f"would fail on the sharded model); write accelerate's config from the plan with `elixir-tune export "
            f"PLAN --to accelerate` and run the script with `accelerate launch --config_file accelerate_config.yaml`, "
            "or search a plan of engine elixir"
        )


# accelerate's mixed precision -> the plan dtype that computes the same way.
_PRECISION_DTYPE = {"no": "fp32", "bf16": "bf16"}


def check_precision(mixed_precision: str, plan_dtype: str) -> None:
    """Refuses accelerate's mixed precision unless it is the plan's dtype.

    Raises:
        PrepareError: naming both and the two ways to agree them.
    """
    asked = str(getattr(mixed_precision, "value", mixed_precision))
    if asked == "fp16":
        raise PrepareError(
            "the script asks accelerate for fp16 mixed precision (fp16=True): accelerate's GradScaler and the "
            "engine's own loss scaling would both apply; use bf16 (bf16=True with a plan searched with "
            "--fix dtype=bf16) or fp32"
        )
    if _PRECISION_DTYPE.get(asked) != plan_dtype:
        setting = "bf16=True" if plan_dtype == "bf16" else "bf16=False and fp16=False"
        raise PrepareError(
            f"the script asks accelerate for mixed precision {asked!r} (TrainingArguments/SFTConfig bf16 and "
            f"fp16; TRL's SFTConfig defaults to bf16=True), the plan trains in {plan_dtype}: set {setting}, or "
            f"search again with --fix dtype={_PRECISION_DTYPE.get(asked, 'fp32')}"
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
