"""What the engine owns, and the objects a script may hold beside it that would train it wrongly.

After ``setup`` a chunked parameter's values live in the engine's shards; the parameter object holds
them only while a module uses it. So three DDP habits would go wrong in silence:

* a second optimizer over some of the model's parameters (not given to ``setup``) would step
  placeholders and change nothing;
* an optimizer given to ``setup`` that holds parameters of another model would train none of them;
* a module added to the model after ``setup`` would run in every forward and never train.

Each is refused with what to do: the optimizer over another model at ``setup``, the second optimizer at
its first ``step()``, the added module at the next forward.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# Per engine of this process (held weakly): its parameters' names by id, and the optimizer that steps them.
_watched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_hook_installed = False


class OwnershipError(RuntimeError):
    """An object beside the engine would change or train the model in a way the engine never sees."""


def check_optimizer_is_over(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raises when ``optimizer`` holds parameters that are not ``model``'s (an optimizer built on another model).

    Raises:
        OwnershipError: naming how many of its parameters are foreign, with what to do.
    """
    own = {id(param) for param in model.parameters()}
    held = [param for group in optimizer.param_groups for param in group["params"]]
    foreign = [param for param in held if id(param) not in own]
    if foreign:
        shapes = ", ".join(str(list(param.shape)) for param in foreign[:3])
        raise OwnershipError(
            f"the optimizer given to elixir_tune.setup holds {len(foreign)} of its {len(held)} parameters outside "
            f"the model given with it (shapes {shapes}); build the optimizer on model.parameters() of that model"
        )


def watch_optimizers(
    owner: object, named_params: Iterable[tuple[str, torch.nn.Parameter]], allowed: torch.optim.Optimizer
) -> None:
    """Refuses, at its first ``step()``, any optimizer other than ``allowed`` over ``named_params``.

    Args:
        owner: the engine (held weakly: the watch ends with it).
        named_params: (name, parameter) of every parameter whose values live in the engine's shards.
        allowed: the sharded optimizer that steps them.
    """
    global _hook_installed
    _watched[owner] = ({id(param): name for name, param in named_params}, weakref.ref(allowed))
    if not _hook_installed:
        register_optimizer_step_pre_hook(_refuse_foreign_step)
        _hook_installed = True


def _refuse_foreign_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for names, allowed in list(_watched.values()):
        if optimizer is allowed():
            continue
        held = [names[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in names]
        if held:
            raise OwnershipError(
                f"a second optimizer ({type(optimizer).__name__}) steps {len(held)} parameters that elixir_tune.setup "
                f"sharded ({', '.join(held[:3])}); their values live in the engine's shards, so it would change "
                "nothing. Give setup one optimizer over all of them: torch param groups keep their own lr and "
                "weight decay (optimizer = AdamW([{'params': a, 'lr': 1e-3}, {'params': b, 'lr': 1e-4}]))"
            )


# Modules and parameters registered in this process since it started (torch's global registration
# hooks count them): a forward walks the model for new parameters only when this moved.
_registrations = [0]


def _count_registration(*_: object) -> None:
    _registrations[0] += 1


def registrations() -> int:
    """How many modules and parameters were registered on any module so far (installs the count)."""
    if not _registrations_hooked:
        torch.nn.modules.module.register_module_module_registration_hook(_count_registration)
        torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
        _registrations_hooked.append(True)
    return _registrations[0]


_registrations_hooked: list[bool] = []


def check_no_new_params(model: torch.nn.Module, known_ids: set[int]) -> None:
    """Raises when ``model`` holds parameters ``setup`` never saw (a module added or replaced after it).

    Raises:
        OwnershipError: naming the new parameters.
    """
    new = [name for name, param in model.named_parameters() if id(param) not in known_ids]
    if new:
        raise OwnershipError(
            f"the model holds {len(new)} parameters that elixir_tune.setup never saw ({', '.join(new[:3])}): a "
            "module added or replaced after setup would run in every forward and never train; build the whole "
            "model before calling setup"
        )


def check_conversion(convert, dtype: torch.dtype, device: torch.device, plan_dtype: str) -> None:
    """Raises when ``convert`` (what ``model.half()``, ``.to(...)``, ``.cuda()`` apply) would change the
    dtype or device of what ``setup`` returned; a conversion to what it already is passes.

    The plan fixes both: the engine keeps fp32 masters and computes in ``training.dtype`` on the plan's
    device, so converting the parameters it lends a module would be undone at the next gather.

    Raises:
        OwnershipError: naming the conversion and what to do instead.
    """
    probe = torch.empty(1, dtype=dtype, device=device)
    try:
        converted = convert(probe)
    except (AssertionError, RuntimeError) as error:  # torch's "not compiled with CUDA", a missing device
        raise OwnershipError(
            f"a move after elixir_tune.setup, which torch cannot make here ({error}): the plan places the "
            f"model on {device}; drop the call, and move the batches instead"
        ) from error
    if converted.dtype != probe.dtype:
        raise OwnershipError(
            f"a {converted.dtype} conversion (model.half(), .to(dtype), ...) after elixir_tune.setup: the plan "
            f"trains in {plan_dtype} with fp32 master weights, and the engine would undo it; for another "
            f"precision search with `--fix dtype=bf16` (or fp16), or drop the call"
        )
    if converted.device != probe.device:
        raise OwnershipError(
            f"a move to {converted.device} (model.to(device), .cuda(), .cpu()) after elixir_tune.setup: the "
            f"plan places the model on {probe.device}; move the batches instead, and save with "
            "model.state_dict(), which gathers the weights"
        )


class WriteWatch:
    """Notices an in-place write to a chunked parameter made through the parameter itself (``p.fill_``,
    ``p.copy_``, ``torch.nn.init``) after ``setup``: its values live in the engine's shards, so the
    write would be lost without a word. Torch counts every in-place change in the parameter's
    ``_version``; the engine's own writes go through payload views of their own counters, never the
    parameter's. Reading the counters costs no device synchronization.
    """

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        self._named = named
        self._versions = [param._version for _, param in named]
        self._total = sum(self._versions)

    def check(self) -> None:
        """Raises OwnershipError when a parameter was written in place since setup (one sum when none was)."""
        # Every root forward comes here (minGPT's generate: once per token): the sum alone, no list, when unchanged.
        if sum(param._version for _, param in self._named) == self._total:
            return
        versions = [param._version for _, param in self._named]
        written = [
            name for (name, _), now, then in zip(self._named, versions, self._versions, strict=True) if now != then
        ]
        self._versions, self._total = versions, sum(versions)
        raise OwnershipError(
            f"{', '.join(written[:3])}{' and others' if len(written) > 3 else ''} written in place after "
            "elixir_tune.setup (p.fill_, p.copy_, torch.nn.init): the values live in the engine's shards, so the "
            "write changed nothing; load new weights with model.load_state_dict(...), or write them before setup"
        )
