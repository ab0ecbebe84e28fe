"""Every pipeline shape plan validation accepts runs, and matches plain PyTorch.

A tiny tied Qwen2 of 2 to 5 blocks on 2 and 3 stages, with each assignment (modular, contiguous) and
each schedule (looped_bfs, interleaved_1f1b, gpipe, 1f1b) that ``schedule_problem`` accepts, among
them the uneven modular splits the search emits (3 blocks on 2 stages: stage 0 runs blocks 0 and 2,
stage 1 block 1, and the loss; torch's own looped schedule failed on them). Two launches, 2 steps
each, fp32: losses 1e-5 relative and weights 1e-5 absolute against plain PyTorch on the same global
batch. The 2-stage cases run at world 4 (pipeline 2 x data 2: each stage's chunks sharded over its
data group, the uneven splits included), the 3-stage cases at world 3 (pipeline 3 x data 1: what
differs from 2 stages is the middle stage, which neither embeds nor computes the loss, and the
schedules over 3 stages; none of it depends on the data degree). The 3-stage cases at data 2 (world
6, six processes) are ``heavy``: ``scripts/test.sh --all`` runs them.
"""

from __future__ import annotations

import pytest

from elixir_tune.plan.stages import schedule_problem
from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LOSS_REL = 1e-5
WEIGHT_ABS = 1e-5
# The world each stage count runs at; the heavy test runs the 3-stage cases at HEAVY_WORLD (data 2).
WORLDS = {2: 4, 3: 3}
HEAVY_WORLD = 6
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
def results() -> dict[int, list[list[dict]]]:
    """Each stage count's launch: its cases' results per rank, in ``CASES`` order."""
    runs = {}
    for stages, world in WORLDS.items():
        cases = [case for case in CASES if case["stages"] == stages]
        runs[stages] = launch("engine_pipeline_shapes_worker.py", cases, world, timeout_s=900)
    return runs


def case_results(runs: dict[int, list[list[dict]]], index: int) -> list[dict]:
    """Each rank's result of ``CASES[index]`` from its stage count's launch."""
    stages = CASES[index]["stages"]
    position = [i for i, case in enumerate(CASES) if case["stages"] == stages].index(index)
    return [rank_results[position] for rank_results in runs[stages]]


def test_the_cases_cover_every_uneven_modular_split():
    uneven = {(c["blocks"], c["stages"]) for c in CASES if c["assignment"] == "modular" and c["blocks"] % c["stages"]}
    assert uneven == {(3, 2), (5, 2), (4, 3), (5, 3)}


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_pipeline_shape_matches_torch(results, index):
    check(CASES[index], case_results(results, index), WORLDS[CASES[index]["stages"]])


@pytest.mark.heavy
def test_three_stages_with_data_2_match_torch():
    """The 3-stage cases at pipeline 3 x data 2 (six processes)."""
    cases = [case for case in CASES if case["stages"] == 3]
    per_rank = launch("engine_pipeline_shapes_worker.py", cases, HEAVY_WORLD, timeout_s=900)
    for position, case in enumerate(cases):
        check(case, [rank_results[position] for rank_results in per_rank], HEAVY_WORLD)


def check(case: dict, per_rank: list[dict], world: int) -> None:
    """One case's results on every rank of a launch of ``world`` ranks."""
    for rank, result in enumerate(per_rank):
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
        assert not result["skipped"], (rank, case)
    first = per_rank[0]
    assert first["loss_rel"] <= LOSS_REL, (case, first["loss_rel"])
    assert first["weight_abs"] <= WEIGHT_ABS, (case, first["weight_abs"])
    # rank = data index x P + stage; stage s runs blocks s, s + P, ... (modular) or its run (contiguous).
    stages = case["stages"]
    assert [(r["data_rank"], r["stage"]) for r in per_rank] == [divmod(rank, stages) for rank in range(world)]
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
