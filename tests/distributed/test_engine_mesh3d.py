"""Pipeline x tensor (x data) in one mesh against plain PyTorch: each pipeline stage's modules are
tensor-parallel within its tensor group, the stages exchange the replicated hidden states, the chunks
are sharded over the data group (engine/parallel/pipeline_tensor.py, engine/comm/mesh.py's Mesh).

Tiny causal LMs (tests/unit/models/stage_families.py: hidden 32, 4 heads with 2 key/value heads,
vocabulary 128), 3 blocks on 2 stages (modular: stage 0 runs blocks 0 and 2, stage 1 block 1, so stage 0
enters and leaves twice), tensor 2, 4 micro-batches of 2 per data rank, 3 AdamW steps, fp32: losses 1e-5
relative, clipped gradient norms 1e-5 relative, final weights 1e-5 absolute. One launch per world size:

* world 4 (pipeline 2 x tensor 2): Llama with sequence parallelism and clipping; Qwen3 (per-head norms)
  without sequence parallelism; Qwen2 with a tied head (the embedding's chunk on both stages, summed over
  the stages at the same tensor index) and padded micro-batches of lengths 7, 5, 7, 6 (padded to 8, a
  multiple of the tensor degree, for the sequence shards).
* world 8 (data 2 x pipeline 2 x tensor 2): Llama, and Qwen3 with half of its chunks offloaded, both
  clipped (the norm over all three dimensions), each data rank reading its own micro-batches through
  ``elixir_tune.data_rank()``; and pipeline 2 x tensor 2d on a 2 x 2 grid (Qwen2, tied head, padded
  micro-batches, 2 steps): a stage sends each rank's samples x hidden-columns piece to its peer. Marked
  ``heavy`` (8 processes): ``scripts/test.sh --all`` runs it; the default leaves it out, pipeline x data
  and tensor x data being checked at world 4 by test_engine_pipeline.py and test_engine_tensor_parallel.py.
"""

from __future__ import annotations

import pytest

from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LOSS_REL = 1e-5
WEIGHT_ABS = 1e-5
STEPS = 3
WORLD4 = [
    dict(family="llama", stages=2, tensor=2, steps=STEPS, clip=0.5),
    dict(family="qwen3", stages=2, tensor=2, steps=STEPS, clip=0.5, sequence_parallel=False),
    dict(family="qwen2", stages=2, tensor=2, steps=STEPS, padded=True),
]
WORLD8 = [
    dict(family="llama", stages=2, tensor=2, steps=STEPS, clip=0.5),
    dict(family="qwen3", stages=2, tensor=2, steps=STEPS, clip=0.5, offload=0.5),
    # pipeline 2 x tensor 2d (a 2 x 2 grid): each rank sends its grid piece, the tied head, padded lengths
    dict(family="qwen2", stages=2, tensor=4, mode="2d", steps=2, padded=True),
]


def case_id(case: dict) -> str:
    extra = "-nosp" if case.get("sequence_parallel") is False else "-padded" if case.get("padded") else ""
    return case["family"] + extra + ("-2d" if case.get("mode") == "2d" else "")


@pytest.fixture(scope="module")
def world4():
    return launch("engine_mesh3d_worker.py", WORLD4, 4, timeout_s=900)


@pytest.fixture(scope="module")
def world8():
    return launch("engine_mesh3d_worker.py", WORLD8, 8, timeout_s=1200)


def check(results: list[list[dict]], index: int, case: dict, world: int) -> None:
    per_rank = [rank_results[index] for rank_results in results]
    for rank, result in enumerate(per_rank):
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
    stages, tensor = case["stages"], case["tensor"]
    data = world // (stages * tensor)
    for rank, result in enumerate(per_rank):
        # rank = (data_index * P + stage) * T + tensor_index; the script's data slice is the data index.
        data_index, stage, tensor_index = result["coords"]
        assert rank == (data_index * stages + stage) * tensor + tensor_index, (rank, result["coords"])
        assert result["data"] == [data_index, data], (rank, result["data"])
        assert result["groups"]["tensor"] == [(data_index * stages + stage) * tensor + t for t in range(tensor)]
        assert result["groups"]["pipeline"] == [
            (data_index * stages + s) * tensor + tensor_index for s in range(stages)
        ]
        assert result["groups"]["data"] == [(d * stages + stage) * tensor + tensor_index for d in range(data)]
        # Every rank of one pipeline and tensor group returns its data rank's loss; the clipped norm is global.
        first_of_group = per_rank[data_index * stages * tensor]
        assert result["losses"] == first_of_group["losses"], rank
        if case.get("clip"):
            assert result["norms"] == per_rank[0]["norms"], rank
        if case.get("mode", "1d") == "1d":  # the report holds what the steps held (the embedding's whole table)
            assert result["held"][0] == result["held"][1] > 0, (rank, result["held"])
    first = per_rank[0]
    assert len(first["losses"]) == case["steps"]
    assert first["loss_rel"] <= LOSS_REL, (case, first["loss_rel"], first["losses"], first["reference_losses"])
    assert first["weight_abs"] <= WEIGHT_ABS, (case, first["weight_abs"])
    assert first["norm_rel"] <= LOSS_REL, (case, first["norm_rel"])


@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[case_id(c) for c in WORLD4])
def test_pipeline2_tensor2_world4_matches_torch(world4, index):
    check(world4, index, WORLD4[index], 4)


@pytest.mark.heavy  # 8 processes; pipeline x tensor runs at world 4 above, each with data in other tests
@pytest.mark.parametrize("index", range(len(WORLD8)), ids=[case_id(c) for c in WORLD8])
def test_pipeline2_tensor2_data2_world8_matches_torch(world8, index):
    check(world8, index, WORLD8[index], 8)
