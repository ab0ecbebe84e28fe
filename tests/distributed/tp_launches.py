"""The tensor-parallel tests' launches, shared: ``test_engine_tensor_parallel.py`` and
``test_engine_tensor_families.py`` both run ``engine_tp_worker.py`` at world 2, and
``test_engine_tensor_parallel.py`` and ``test_engine_tensor_grid.py`` at world 4, so each world is
one launch of both modules' cases (started by whichever module's test runs first, kept for the test
session) instead of two: one fork, process-group start and model-module import per rank fewer.

Selecting one module's tests (``-k grid``) still runs both modules' cases of that world.
"""

from __future__ import annotations

import functools

from tests.distributed.engine_launch import launch


@functools.cache
def _world(world: int) -> dict[str, list[list[dict]]]:
    """Each module's results per rank at ``world`` (module name -> per rank, its cases in order)."""
    from tests.distributed import test_engine_tensor_families, test_engine_tensor_grid, test_engine_tensor_parallel

    parts = {
        2: {
            "tensor_parallel": test_engine_tensor_parallel.WORLD2,
            "tensor_families": test_engine_tensor_families.CASES,
        },
        4: {"tensor_parallel": test_engine_tensor_parallel.WORLD4, "tensor_grid": test_engine_tensor_grid.CASES},
    }[world]
    cases = [case for part in parts.values() for case in part]
    per_rank = launch("engine_tp_worker.py", cases, world, timeout_s=300 + 60 * len(cases))
    results, start = {}, 0
    for name, part in parts.items():
        results[name] = [rank_results[start : start + len(part)] for rank_results in per_rank]
        start += len(part)
    return results


def tp_results(module: str, world: int) -> list[list[dict]]:
    """The results per rank of ``module``'s cases ("tensor_parallel", "tensor_families" or
    "tensor_grid") at ``world`` (2 or 4), from the shared launch of that world."""
    return _world(world)[module]
