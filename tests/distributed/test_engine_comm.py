"""engine/comm/ on real gloo processes: native collectives and the fallbacks old gloo needs."""

import pytest

from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.parametrize("world", [2, 4])
def test_collectives(world):
    for rank, (checks,) in enumerate(launch("engine_comm_worker.py", [], world, timeout_s=120)):
        assert checks and all(checks.values()), (rank, checks)
