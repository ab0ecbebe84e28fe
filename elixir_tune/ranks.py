"""Which share of the data this process reads: its data-parallel index and the data-parallel degree.

Under a plan with pipeline stages or tensor parallelism several ranks hold one replica of the model
and must be fed the same micro-batches; slicing the data by ``RANK`` / ``WORLD_SIZE`` (as a DDP or
FSDP script does) gives them different ones. ``data_rank()`` and ``data_size()`` are the slice a
script takes under any plan (``rank = (data_rank x P + stage) x T + tensor_index``, plan/schema.py
``ParallelPlan``); under a data-parallel plan they equal ``RANK`` and ``WORLD_SIZE``.

The plan is the one ``elixir_tune.setup`` runs (once it has run), else the one ``elixir-run`` names in
``$ELIXIR_TUNE_PLAN``; without either, the process is the only one (0 of 1). Imports no torch.
"""

from __future__ import annotations

import os
from functools import lru_cache

from elixir_tune.plan.io import PLAN_ENV_VAR, load_plan
from elixir_tune.plan.schema import Plan

_active: tuple[Plan, int] | None = None


def use_plan(plan: Plan, rank: int) -> None:
    """Makes ``plan`` and this process's global ``rank`` the ones ``data_rank``/``data_size`` answer
    for (``setup`` calls it once the process group is up)."""
    global _active
    _active = (plan, rank)


@lru_cache(maxsize=4)
def _plan_at(path: str) -> Plan:
    return load_plan(path)


def _plan() -> Plan | None:
    if _active is not None:
        return _active[0]
    path = os.environ.get(PLAN_ENV_VAR)
    return _plan_at(path) if path else None


def _rank() -> int:
    return _active[1] if _active is not None else int(os.environ.get("RANK", "0"))


def data_size() -> int:
    """The data-parallel degree: how many different shares the data is cut into (world / (P x T))."""
    plan = _plan()
    if plan is None:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return plan.data_parallel_size


def data_rank() -> int:
    """This process's share of the data, 0 to ``data_size() - 1``: every rank of one pipeline and
    tensor group gets the same index, and must read the same micro-batches."""
    plan = _plan()
    if plan is None:
        return _rank()
    return _rank() // plan.parallel.model_parallel_size


def mesh_groups(world_size: int, pipeline: int, tensor: int, context: int = 1) -> dict[str, list[list[int]]]:
    """Which global ranks form each group of the mesh (``rank = ((data_index x P + stage) x C + context_index) x T
    + tensor_index``).

    Args:
        world_size: every process (data x pipeline x tensor).
        pipeline: pipeline stages P.
        tensor: tensor degree T.
        context: context degree C (its own groups are shown by ``show``).

    Returns:
        ``{"tensor": ..., "pipeline": ..., "data": ...}``, each a list of groups (global ranks in group-rank
        order): a tensor group is T consecutive ranks (one node), a pipeline group the P stages at one data
        and context and tensor index, a data group the ranks at one stage and tensor index (data x context:
        the chunks are sharded over them).

    Raises:
        ValueError: pipeline x context x tensor does not divide the world.
    """
    if pipeline < 1 or tensor < 1 or context < 1 or world_size % (pipeline * context * tensor):
        raise ValueError(
            f"pipeline {pipeline} x context {context} x tensor {tensor} does not divide the world size {world_size}"
        )
    data = world_size // (pipeline * context * tensor)
    shares = [(d, c) for d in range(data) for c in range(context)]  # data x context, in rank order

    def rank(d: int, s: int, c: int, t: int) -> int:
        return ((d * pipeline + s) * context + c) * tensor + t

    return {
        "tensor": [
            [rank(d, s, c, t) for t in range(tensor)]
            for d in range(data)
            for s in range(pipeline)
            for c in range(context)
        ],
        "pipeline": [[rank(d, s, c, t) for s in range(pipeline)] for d, c in shares for t in range(tensor)],
        "data": [[rank(d, s, c, t) for d, c in shares] for s in range(pipeline) for t in range(tensor)],
    }
