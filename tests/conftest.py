"""Shared test settings.

``tests`` is a package (every folder has an ``__init__.py``), so pytest puts the repository root
on the import path and helpers are imported by their full name, e.g.
``from tests.distributed.engine_plans import make_plan``; worker scripts started as subprocesses
get the root through ``PYTHONPATH`` (tests/distributed/engine_launch.py, tests/e2e/launch_helpers.py).

Markers (registered in pyproject.toml):
    slow         multi-process or end-to-end, seconds each; ``scripts/test.sh --fast`` leaves them out
    distributed  starts several processes (gloo on the CPU); always also slow
    gpu          needs CUDA: skipped here when torch sees no GPU
    heavy        6 or 8 processes on the CPU, a layout the other tests check at a smaller world: left out
                 by ``scripts/test.sh`` unless ``--all``; always also slow
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items:
        import torch  # only when a gpu test is collected: most runs need no torch here

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
            for item in gpu_items:
                item.add_marker(skip)
    for item in items:
        for marker in ("distributed", "heavy"):
            if item.get_closest_marker(marker) and not item.get_closest_marker("slow"):
                raise pytest.UsageError(f"{item.nodeid} is marked {marker} but not slow; mark it slow too")
