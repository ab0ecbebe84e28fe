"""A pipeline plan promises each stage's memory (``prediction.stages``, ``Plan.rank_memory``): the
search writes every stage's figures as it scored them, the file keeps them, each rank maps to its
stage, and plans without a pipeline read and write as before."""

from __future__ import annotations

import dataclasses

import pytest

from elixir_tune.costmodel.synthetic import example_hardware, gpt2_profile
from elixir_tune.plan import load_plan, save_plan
from elixir_tune.search import search


@pytest.fixture(scope="module")
def profile():
    return gpt2_profile("p", hidden=64, layers=4, heads=4, vocab=256, positions=32, seq_len=32)


def searched(profile, gpus: int, pins: list[str]):
    return search(
        profile, example_hardware(gpus_per_node=gpus), gpus_per_node=gpus, global_batch_size=8,
        fixed=["micro_batch_size=2", "dtype=fp32", *pins], loop="forward_backward",
    )  # fmt: skip


def test_every_stage_is_promised_as_the_search_scored_it(profile, tmp_path):
    result = searched(profile, 4, ["pipeline=2", "tensor=2"])
    plan = result.plan
    assert plan.prediction is not None
    scored = [candidate.memory for _, candidate in result.candidates[0].stages]
    stages = plan.prediction.stages
    assert [entry.stage for entry in stages] == [0, 1]
    for entry, memory in zip(stages, scored, strict=True):
        assert entry.model_state_bytes == memory.model_state_bytes
        assert entry.transient_bytes == memory.transient_bytes
        assert (entry.peak_gpu_bytes, entry.peak_host_bytes) == (memory.peak_gpu_bytes, memory.peak_host_bytes)
    assert stages[0].model_state_bytes != stages[1].model_state_bytes  # the stages hold different chunks
    # The headline figures are the stage with the highest device peak, all of one stage.
    top = max(stages, key=lambda entry: entry.peak_gpu_bytes)
    assert plan.prediction.peak_gpu_bytes == top.peak_gpu_bytes
    assert plan.prediction.model_state_bytes == top.model_state_bytes
    save_plan(plan, tmp_path / "plan.yaml")
    loaded = load_plan(tmp_path / "plan.yaml")
    assert loaded.prediction is not None and loaded.prediction.stages == stages
    # rank = (data_index x P + stage) x T + tensor_index: ranks 0, 1 on stage 0, ranks 2, 3 on stage 1
    assert [loaded.rank_memory(rank).stage for rank in range(4)] == [0, 0, 1, 1]
    assert loaded.rank_memory(3) == stages[1]
    with pytest.raises(ValueError, match="outside the plan's world of 4"):
        loaded.rank_memory(4)


def test_a_plan_without_pipeline_writes_no_stages_and_promises_its_own_figures(profile, tmp_path):
    plan = searched(profile, 2, ["pipeline=1", "tensor=1"]).plan
    assert plan.prediction is not None and plan.prediction.stages == []
    save_plan(plan, tmp_path / "plan.yaml")
    assert "stages:" not in (tmp_path / "plan.yaml").read_text()
    promise = load_plan(tmp_path / "plan.yaml").rank_memory(1)
    assert promise.model_state_bytes == plan.prediction.model_state_bytes
    assert promise.transient_bytes == plan.prediction.transient_bytes
    no_prediction = dataclasses.replace(plan, prediction=None)
    with pytest.raises(ValueError, match="no prediction"):
        no_prediction.rank_memory(0)
