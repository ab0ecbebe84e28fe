"""Parameters read outside their own module's forward, on a real model: transformers' Mamba, whose
mixer reads its ``conv1d`` and ``dt_proj`` parameters with functional calls. The engine (gloo, CPU,
world size 2, real processes, plans from the real profiler and search with half the shards
offloaded) must train it exactly like plain PyTorch on the same global batch, with and without
checkpointing; a plan whose record of those reads is removed must stop at the first step with an
error that names the parameter.

Tolerances as in test_engine_archs.py: losses 1e-5 relative, final weights 1e-5 absolute (fp32).
"""

from __future__ import annotations

import pytest

from tests.distributed.engine_launch import launch

LOSS_REL = 1e-5
WEIGHT_ABS = 1e-5
STEPS = 5

CASES = [
    dict(checkpointing="all", steps=STEPS, global_batch=8),
    dict(checkpointing="none", steps=STEPS, global_batch=8),
    dict(checkpointing="all", steps=STEPS, global_batch=8, drop_reads=True),
]
MIXER_READS = ["conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias"]

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def world2():
    return launch("engine_foreign_reads_worker.py", CASES, 2, timeout_s=600)


def results(world2, index: int) -> list[dict]:
    found = [rank_results[index] for rank_results in world2]
    for rank, result in enumerate(found):
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
    return found


@pytest.mark.parametrize("index", [0, 1], ids=["checkpointed", "plain"])
def test_mamba_matches_torch(world2, index):
    first = results(world2, index)[0]
    plan = first["plan"]
    assert plan["foreign_reads"] == [
        [f"backbone.layers.{layer}.mixer", [f"backbone.layers.{layer}.mixer.{name}" for name in MIXER_READS]]
        for layer in range(2)
    ]
    assert plan["offloaded"] > 0 and plan["checkpoint_every"] == (1 if index == 0 else 0), plan
    assert plan["cache_blocks"] < plan["chunks"] - plan["resident"], plan
    assert first["gathers"] > STEPS * plan["chunks"], first["gathers"]  # evicted chunks were gathered again
    assert len(first["world_losses"]) == STEPS
    assert first["loss_rel"] <= LOSS_REL, first["loss_rel"]
    assert first["weight_abs"] <= WEIGHT_ABS, first["weight_abs"]


def test_unrecorded_read_stops_the_first_step_on_every_rank(world2):
    for result in results(world2, 2):
        assert "world_losses" not in result
        assert "'backbone.layers.0.mixer.conv1d.weight'" in result["error"], result["error"]
        assert "model.foreign_reads" in result["error"] and "elixir-tune profile" in result["error"]
