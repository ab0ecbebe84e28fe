"""Collectives for the engine: the only package of ``elixir_tune.engine`` that calls torch.distributed.

Thin wrappers over torch.distributed with three extras:
    * a world of one needs no process group: every collective is a local copy;
    * gloo lacks ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in some torch versions
      (2.5, which made DTensor public, to the newest are supported): the wrappers fall back to list
      all-gather and all-reduce;
    * every asynchronous call returns a :class:`Handle` whose ``wait()`` also runs the fallback's
      finishing copy, so callers never see the difference.

Modules: ``collectives`` (Handle, Comm: one group's collectives), ``process_group`` (joining the
world, the collective timeout), ``mesh`` (the data x pipeline x tensor mesh and sub-groups). The
engine imports every name from here; DTensor's and tensor parallelism's names are imported on
first use.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any, TypeGuard

from elixir_tune.engine.comm.collectives import DONE, Comm, Handle, gather_objects, pick_device, pipelining
from elixir_tune.engine.comm.mesh import MESH_DIMS, Mesh, grid_device_mesh, init_mesh, subgroup
from elixir_tune.engine.comm.process_group import (
    COLLECTIVE_TIMEOUT_ENV,
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    collective_timeout_s,
    init_comm,
)

if TYPE_CHECKING:  # the lazy names below, for type checkers
    from torch.distributed.device_mesh import DeviceMesh  # noqa: F401
    from torch.distributed.tensor import (  # noqa: F401
        DTensor,
        Partial,
        Replicate,
        Shard,
        distribute_module,
        distribute_tensor,
    )
    from torch.distributed.tensor.experimental import implicit_replication  # noqa: F401
    from torch.distributed.tensor.parallel import (  # noqa: F401
        ColwiseParallel,
        ParallelStyle,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

# DTensor and tensor-parallel APIs, for engine/parallel/tensor_parallel.py, engine/parallel/tp_adapters.py and
# engine/parallel/tp_grid.py (this package stays the engine's only torch.distributed user). They are imported
# on first use (``__getattr__``): loading torch.distributed.tensor takes about half a second, which
# a plan without tensor parallelism need not pay in every process.
_LAZY_MODULES = {
    "DeviceMesh": "torch.distributed.device_mesh",
    **dict.fromkeys(
        ("DTensor", "Partial", "Replicate", "Shard", "distribute_module", "distribute_tensor"),
        "torch.distributed.tensor",
    ),
    "implicit_replication": "torch.distributed.tensor.experimental",
    **dict.fromkeys(
        (
            "ColwiseParallel",
            "ParallelStyle",
            "PrepareModuleInput",
            "PrepareModuleOutput",
            "RowwiseParallel",
            "SequenceParallel",
            "loss_parallel",
            "parallelize_module",
        ),
        "torch.distributed.tensor.parallel",
    ),
}


def __getattr__(name: str) -> Any:
    """The DTensor and tensor-parallel names (``_LAZY_MODULES``), imported when first asked for."""
    module = _LAZY_MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor, without importing DTensor: no DTensor can exist before
    torch.distributed.tensor is loaded, so a process that never loaded it has none."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


__all__ = [
    "COLLECTIVE_TIMEOUT_ENV",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "DONE",
    "MESH_DIMS",
    "Comm",
    "Handle",
    "Mesh",
    "collective_timeout_s",
    "gather_objects",
    "grid_device_mesh",
    "init_comm",
    "init_mesh",
    "is_dtensor",
    "pick_device",
    "pipelining",
    "subgroup",
]
