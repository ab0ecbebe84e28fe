"""Every pipeline shape plan validation accepts runs, and matches plain PyTorch.

A tiny tied Qwen2 of 2 to 5 blocks on 2 and 3 stages, with each assignment (modular, contiguous) and
each schedule (looped_bfs, interleaved_1f1b, gpipe, 1f1b) that ``schedule_problem`` accepts, among
them the uneven modular splits the search emits (3 blocks on 2 stages: stage 0 runs blocks 0 and 2,
stage 1 block 1, and the loss; torch's own looped schedule failed on them). One launch of world 6
(pipeline 2 x data 3 and pipeline 3 x data 2), 2 steps each, fp32: losses 1e-5 relative and weights
1e-5 absolute against plain PyTorch on the same global batch.
"""

from __future__ import annotations

import pytest

from elixir_tune.plan.stages import schedule_problem
from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LOSS_REL = 1e-5
WEIGHT_ABS = 1e-5
WORLD = 6  # both 2 and 3 stages divide it
SCHEDULES = ("looped_bfs", "interleaved_1f1b", "gpipe", "1f1b")


def shape_cases() -> list[dict]:
    """Every accepted (blocks, stages, assignment, schedule); contiguous is left out where it equals
    modular (as many blocks as stages)."""
    cases = []
    for blocks in (2, 3, 4, 5):
        for stages in (2, 3):
            if stages > blocks:
                continue
            for assignment in ("modular", "contiguous") if blocks > stages else ("modular",):
                for schedule in SCHEDULES:
                    accum = 4
                    if schedule_problem(blocks, stages, assignment, schedule, accum) is None:
                        cases.append(
                            dict(blocks=blocks, stages=stages, assignment=assignment, schedule=schedule, accum=accum)
                        )
    # The reported defect (8 micro-batches), and fewer micro-batches than stages.
    cases.append(dict(blocks=3, stages=2, assignment="modular", schedule="looped_bfs", accum=8))
    cases.append(dict(blocks=5, stages=3, assignment="modular", schedule="looped_bfs", accum=2))
    return cases


CASES = shape_cases()


def case_id(case: dict) -> str:
    return f"b{case['blocks']}-p{case['stages']}-{case['assignment']}-{case['schedule']}-m{case['accum']}"


@pytest.fixture(scope="module")
def results():
    return launch("engine_pipeline_shapes_worker.py", CASES, WORLD, timeout_s=900)


def test_the_cases_cover_every_uneven_modular_split():
    uneven = {(c["blocks"], c["stages"]) for c in CASES if c["assignment"] == "modular" and c["blocks"] % c["stages"]}
    assert uneven == {(3, 2), (5, 2), (4, 3), (5, 3)}


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_pipeline_shape_matches_torch(results, index):
    per_rank = [rank_results[index] for rank_results in results]
    for rank, result in enumerate(per_rank):
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
    case = CASES[index]
    first = per_rank[0]
    assert first["loss_rel"] <= LOSS_REL, (case, first["loss_rel"])
    assert first["weight_abs"] <= WEIGHT_ABS, (case, first["weight_abs"])
    # rank = data index x P + stage; stage s runs blocks s, s + P, ... (modular) or its run (contiguous).
    stages = case["stages"]
    assert [(r["data_rank"], r["stage"]) for r in per_rank] == [divmod(rank, stages) for rank in range(WORLD)]
    for result in per_rank:
        blocks = [b for run in result["virtual"] for b in run]
        if case["assignment"] == "modular":
            assert blocks == list(range(result["stage"], case["blocks"], stages))
        else:
            assert len(result["virtual"]) == 1 and blocks == sorted(blocks)
    if case["schedule"] == "1f1b":  # one micro-batch: the same reason plan validation gives
        assert all("1f1b needs at least as many micro-batches per step as stages" in r["refused"] for r in per_rank)
    # Every rank of a data index returns its step's loss (broadcast from the stage with the last block).
    for result in per_rank:
        peers = [r for r in per_rank if r["data_rank"] == result["data_rank"]]
        assert all(r["losses"] == result["losses"] for r in peers)
