"""Pipeline x tensor x data in one mesh, the parts that need no process group: which ranks form each
group (``elixir_tune.ranks.mesh_groups``, the order ``engine/comm/mesh.py``'s Mesh builds), what ``setup``
refuses for such a plan, and the stage boundary's lengths (``engine/parallel/pipeline_tensor.py``).
The engine itself runs in tests/distributed/test_engine_mesh3d.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from elixir_tune.engine.parallel.pipeline_tensor import StageBoundary, check_combined
from elixir_tune.engine.parallel.tp_layout import TensorParallelError
from elixir_tune.paths import CONFIGS_DIR
from elixir_tune.plan import load_plan
from elixir_tune.plan.schema import ParallelPlan, PipelineParallel, TensorParallel
from elixir_tune.ranks import mesh_groups


def test_mesh_groups_put_tensor_fastest_then_pipeline_then_data():
    groups = mesh_groups(16, pipeline=2, tensor=4)  # data 2
    assert groups["tensor"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert groups["pipeline"][:5] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12]]
    assert groups["data"][:2] == [[0, 8], [1, 9]]
    for kind, size in (("tensor", 4), ("pipeline", 2), ("data", 2)):
        members = sorted(rank for group in groups[kind] for rank in group)
        assert members == list(range(16)) and {len(group) for group in groups[kind]} == {size}
    # every rank sits in exactly one group of each kind, at (data_index x P + stage) x T + tensor_index
    for rank in range(16):
        data_index, rest = divmod(rank, 8)
        stage, tensor_index = divmod(rest, 4)
        assert [g for g in groups["data"] if rank in g][0].index(rank) == data_index
        assert [g for g in groups["pipeline"] if rank in g][0].index(rank) == stage
        assert [g for g in groups["tensor"] if rank in g][0].index(rank) == tensor_index
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        mesh_groups(6, pipeline=2, tensor=2)


def _combined(mode: str = "1d"):
    plan = load_plan(CONFIGS_DIR / "plans" / "example.yaml")
    parallel = ParallelPlan(pipeline=PipelineParallel(stages=2), tensor=TensorParallel(degree=4, mode=mode))
    return dataclasses.replace(plan, parallel=parallel)


def test_setup_refuses_what_a_pipeline_by_tensor_plan_cannot_run():
    check_combined(_combined(), vocab_parallel_loss=False)  # 1d, whole logits: runs
    check_combined(_combined("2d"), vocab_parallel_loss=False)  # the 2d grid's pieces cross stages too
    with pytest.raises(TensorParallelError, match="call setup without vocab_parallel_loss"):
        check_combined(_combined(), vocab_parallel_loss=True)


def test_stage_boundary_sends_sequence_shards_only_with_sequence_parallelism():
    plain = StageBoundary(None)
    hidden = torch.ones(2, 7, 4)
    assert plain.padded_length(7) == 7 and plain.sent_shape(2, 8, 4) == (2, 8, 4)
    assert plain.enter(hidden) is hidden and plain.leave(hidden) is hidden and plain.widen(hidden) is hidden
    # a tensor split's mode and flags only (its DTensor side runs in the distributed test)
    sharded = StageBoundary(SimpleNamespace(mode="1d", sequence_parallel=True, degree=4))  # type: ignore[arg-type]
    assert sharded.padded_length(7) == 8 and sharded.padded_length(8) == 8 and sharded.sent_shape(2, 8, 4) == (2, 2, 4)
    wide = sharded.widen(torch.ones(2, 2, 4))
    assert wide.shape == (2, 8, 4) and not wide.any()
    with pytest.raises(TensorParallelError, match="sequence_parallel: false"):
        sharded.leave(hidden)
    replicated = StageBoundary(SimpleNamespace(mode="1d", sequence_parallel=False, degree=4))  # type: ignore[arg-type]
    assert replicated.padded_length(7) == 7 and replicated.sent_shape(2, 8, 4) == (2, 8, 4)
    # the 2d grid (2 x 2): a rank sends its row's samples and its column's hidden features, whole sequences
    grid = StageBoundary(SimpleNamespace(mode="2d", sequence_parallel=True, degree=4))  # type: ignore[arg-type]
    assert grid.padded_length(7) == 7 and grid.sent_shape(4, 8, 32) == (2, 8, 16)
    assert grid.widen(torch.ones(2, 8, 16)).shape == (4, 8, 32)
    with pytest.raises(TensorParallelError, match="Shard"):
        grid.leave(hidden)
