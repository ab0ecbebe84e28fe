"""engine/comm/mesh.py's mesh on real gloo processes: groups follow rank = (data * P + stage) * T + tensor.

One launch of world 4 builds the three meshes in turn: pipeline 2 x data 2, tensor 2 x data 2 and
pipeline 2 x tensor 2.
"""

import pytest

from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORLD = 4
SHAPES = [(2, 1), (1, 2), (2, 2)]  # (pipeline, tensor)


@pytest.fixture(scope="module")
def results():
    cases = [{"pipeline": pipeline, "tensor": tensor} for pipeline, tensor in SHAPES]
    return launch("engine_mesh_worker.py", cases, WORLD, timeout_s=240)


@pytest.mark.parametrize("index", range(len(SHAPES)), ids=[f"pipeline{p}-tensor{t}" for p, t in SHAPES])
def test_mesh_groups_follow_the_rank_layout(results, index):
    pipeline, tensor = SHAPES[index]
    data = WORLD // (pipeline * tensor)
    for rank, rank_results in enumerate(results):
        report = rank_results[index]
        assert report["ok"], (rank, report.get("error"), report.get("trace"))
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
