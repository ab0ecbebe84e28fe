"""engine/comm.py on real gloo processes: native collectives and the fallbacks old gloo needs."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_launch import launch  # noqa: E402


@pytest.mark.parametrize("world", [2, 4])
def test_collectives(world):
    for rank, (checks,) in enumerate(launch("engine_comm_worker.py", [], world, timeout_s=120)):
        assert checks and all(checks.values()), (rank, checks)
