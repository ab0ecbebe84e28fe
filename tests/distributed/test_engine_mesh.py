"""engine/comm/mesh.py's mesh on real gloo processes: groups follow rank = (data * P + stage) * T + tensor."""

import pytest

from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.parametrize(("pipeline", "tensor"), [(2, 1), (1, 2), (2, 2)])
def test_mesh_groups_follow_the_rank_layout(pipeline, tensor):
    world = 4
    data = world // (pipeline * tensor)
    results = launch("engine_mesh_worker.py", [{"pipeline": pipeline, "tensor": tensor}], world, timeout_s=120)
    for rank, (report,) in enumerate(results):
        assert report["layout"], (rank, report)
        assert report["sizes"] == [data, pipeline, tensor], report
        assert report["device_mesh"] == ["data", "pipeline", "tensor"]
        stage_index, tensor_index = (rank // tensor) % pipeline, rank % tensor
        data_index = rank // (pipeline * tensor)
        members = {
            "data": [(d * pipeline + stage_index) * tensor + tensor_index for d in range(data)],
            "pipeline": [(data_index * pipeline + s) * tensor + tensor_index for s in range(pipeline)],
            "tensor": [(data_index * pipeline + stage_index) * tensor + t for t in range(tensor)],
        }
        for name, (total, expected_total, size, broadcast_ok) in report["sums"].items():
            assert total == sum(members[name]) == expected_total, (rank, name, report)
            assert size == len(members[name]) and broadcast_ok, (rank, name)
