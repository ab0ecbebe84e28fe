"""Scripts that run under elixir-run without using the plan: refused at once, or named at exit.

An unchanged DDP script runs under elixir-run (it is a torchrun launcher), trains as plain DDP and
ignores the plan: the chunks, the offload and the memory the search promised. So in each worker:

* constructing ``torch.nn.parallel.DistributedDataParallel`` raises at once, saying what to write
  instead (``$ELIXIR_TUNE_ALLOW_DDP=1`` allows it, e.g. for a DDP baseline under the same launcher);
* a script that ends without ever calling ``elixir_tune.setup`` gets one line on rank 0 saying that
  the plan was not used.

Imports no torch: the guard wraps DDP when the script's own ``import torch`` loads it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

ALLOW_DDP_ENV = "ELIXIR_TUNE_ALLOW_DDP"
_DDP_MODULE = "torch.nn.parallel.distributed"
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


class _DDPFinder(importlib.abc.MetaPathFinder):
    """Finds torch's DDP module as usual, then wraps the class's constructor once it is loaded."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _DDP_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return None
        load = loader.exec_module

        def exec_module(module: Any) -> None:
            load(module)
            ddp = getattr(module, "DistributedDataParallel", None)
            if ddp is not None:
                ddp.__init__ = _refusing_init(ddp.__init__)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def refuse_ddp() -> None:
    """Makes DDP's constructor raise in this process (unless ``$ELIXIR_TUNE_ALLOW_DDP`` is 1)."""
    if os.environ.get(ALLOW_DDP_ENV) == "1" or _DDP_MODULE in sys.modules:
        return
    sys.meta_path.insert(0, _DDPFinder())


def unused_plan_note() -> str | None:
    """The line to print when the script ended without calling ``elixir_tune.setup``; None if it did."""
    setup = sys.modules.get("elixir_tune.engine.setup")
    if setup is not None and getattr(setup, "setup_calls", 0) > 0:
        return None
    return (
        "elixir-run: the script never called elixir_tune.setup(model, optimizer), so the plan was not used (it "
        f"ran as plain PyTorch); to train as planned, {PORT_HINT}"
    )
