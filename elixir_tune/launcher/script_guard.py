"""Scripts that run under elixir-run without using the plan: refused at once, or named at exit.

An unchanged DDP script runs under elixir-run (it is a torchrun launcher), trains as plain DDP and
ignores the plan: the chunks, the offload and the memory the search promised. So in each worker:

* constructing ``torch.nn.parallel.DistributedDataParallel`` raises at once, saying what to write
  instead (``$ELIXIR_TUNE_ALLOW_DDP=1`` allows it, e.g. for a DDP baseline under the same launcher);
* accelerate's ``Accelerator.prepare`` sets the model up on the plan instead (Trainer, TRL and
  accelerate loops run unchanged: ``elixir_tune/integrations/accelerate.py``);
* a script that ends without ever calling ``elixir_tune.setup`` gets one line on rank 0 saying that
  the plan was not used.

Imports no torch: the guard wraps DDP when the script's own ``import torch`` loads it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from typing import Any

ALLOW_DDP_ENV = "ELIXIR_TUNE_ALLOW_DDP"
_DDP_MODULE = "torch.nn.parallel.distributed"
_ACCELERATOR_MODULE = "accelerate.accelerator"
PORT_HINT = (
    "replace `model = DDP(model, ...)` with `model, optimizer = elixir_tune.setup(model, optimizer)` "
    "(README: Your own training script)"
)


def _refusing_init(original: Any) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "elixir-run: this script wraps the model in DistributedDataParallel, which would train it as plain "
            f"DDP and ignore the plan; {PORT_HINT}; set {ALLOW_DDP_ENV}=1 to run DDP under elixir-run anyway"
        )

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __init__


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Finds one module as usual, then runs ``patch(module)`` once it is loaded."""

    def __init__(self, name: str, patch: Callable[[Any], None]):
        self.name = name
        self.patch = patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return None
        load = loader.exec_module

        def exec_module(module: Any) -> None:
            load(module)
            self.patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _refuse_ddp_in(module: Any) -> None:
    ddp = getattr(module, "DistributedDataParallel", None)
    if ddp is not None:
        ddp.__init__ = _refusing_init(ddp.__init__)


def _prepare_on_plan(module: Any) -> None:
    from elixir_tune.integrations.accelerate import install  # loads torch, which accelerate already did

    install(module)


def refuse_ddp() -> None:
    """Makes DDP's constructor raise in this process (unless ``$ELIXIR_TUNE_ALLOW_DDP`` is 1), and sets
    up on the plan the model that accelerate (Trainer, TRL, accelerate loops) prepares
    (``elixir_tune/integrations/accelerate.py``)."""
    if os.environ.get(ALLOW_DDP_ENV) == "1":
        return
    if _DDP_MODULE not in sys.modules:
        sys.meta_path.insert(0, _PatchOnLoad(_DDP_MODULE, _refuse_ddp_in))
    if _ACCELERATOR_MODULE not in sys.modules:
        sys.meta_path.insert(0, _PatchOnLoad(_ACCELERATOR_MODULE, _prepare_on_plan))


def unused_plan_note() -> str | None:
    """The line to print when the script ended without calling ``elixir_tune.setup``; None if it did."""
    setup = sys.modules.get("elixir_tune.engine.setup")
    if setup is not None and getattr(setup, "setup_calls", 0) > 0:
        return None
    return (
        "elixir-run: the script never called elixir_tune.setup(model, optimizer), so the plan was not used (it "
        f"ran as plain PyTorch); to train as planned, {PORT_HINT}"
    )
