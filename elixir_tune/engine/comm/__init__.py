"""Collectives for the engine: the only package of ``elixir_tune.engine`` that calls torch.distributed.

Its modules, each for one job, and what callers import from here:
    * ``collectives.py``: ``Comm`` (one process group's collectives, with a local copy for a group
      of one and gloo's fallbacks) and the ``Handle`` of an asynchronous one; ``gather_objects``;
      ``shared_errors`` (every rank learns every rank's failure before any raises);
    * ``mesh.py``: joining the process group (``init_comm``, ``init_mesh``), the data x pipeline x
      tensor ``Mesh``, the 2D tensor grid and groups over given ranks (``subgroup``);
    * ``experts.py``: expert parallelism's groups and its differentiable all-to-all;
    * this file: DTensor's and tensor parallelism's names, imported on first use
      (``comm.DTensor``, ``comm.parallelize_module``...), and ``pipelining()``.

The worker's device and the collective timeout, which need no torch.distributed, are in
``engine/worker.py``.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any, TypeGuard

from elixir_tune.engine.comm.collectives import DONE, Comm, Handle, gather_objects, shared_errors
from elixir_tune.engine.comm.experts import all_to_all_rows, exchange_counts, expert_groups
from elixir_tune.engine.comm.mesh import (
    MESH_DIMS,
    Mesh,
    grid_device_mesh,
    init_comm,
    init_group_of_one,
    init_mesh,
    subgroup,
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


def pipelining():
    """``torch.distributed.pipelining`` (PipelineStage and the schedules), imported on first use: it
    takes about a second and only pipeline plans need it."""
    import torch.distributed.pipelining as torch_pipelining

    return torch_pipelining


__all__ = [
    "DONE",
    "MESH_DIMS",
    "Comm",
    "Handle",
    "Mesh",
    "all_to_all_rows",
    "exchange_counts",
    "expert_groups",
    "gather_objects",
    "grid_device_mesh",
    "init_comm",
    "init_group_of_one",
    "init_mesh",
    "is_dtensor",
    "pipelining",
    "shared_errors",
    "subgroup",
]
