"""The engine's run checks on real process groups (world 2, gloo, the tiny GPT-2):

* the data contract: under a tensor-2 or a pipeline-2 plan both ranks share data index 0; fed
  RANK-sliced data (rank 1 gets an empty batch) the first step is refused on both ranks with a
  ContractError naming the ranks and data_rank() / data_size(); fed the same data they train as
  plain PyTorch does (1e-5);
* non-finite steps: a NaN micro-batch on one rank of a data-parallel pair, or lr 1e6 on a pipeline
  (fp32) and a tensor pair (bf16), stops both ranks at the same step with a NonFiniteError naming
  it, the weights finite and those before that step.
"""

from __future__ import annotations

import pytest

from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CASES = [
    dict(check="contract", layout="tensor", slice="rank"),
    dict(check="contract", layout="tensor", slice="data"),
    dict(check="contract", layout="pipeline", slice="rank"),
    dict(check="contract", layout="pipeline", slice="data"),
    dict(check="nonfinite", layout="data", nan_rank=1, nan_step=1),
    dict(check="nonfinite", layout="pipeline", lr=1e6),
    dict(check="nonfinite", layout="tensor", lr=1e6, dtype="bf16"),
]


def case_id(case: dict) -> str:
    return "-".join(str(value) for value in case.values())


@pytest.fixture(scope="module")
def results():
    return launch("engine_checks_worker.py", CASES, 2, timeout_s=400)


def _ranks(results, index: int) -> list[dict]:
    per_rank = [rank_results[index] for rank_results in results]
    for rank, result in enumerate(per_rank):
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
    return per_rank


@pytest.mark.parametrize("index", [0, 2], ids=["tensor", "pipeline"])
def test_rank_sliced_data_is_refused_at_the_first_step_on_every_rank(results, index):
    for result in _ranks(results, index):
        error = result["error"]
        assert error is not None and error["type"] == "ContractError" and error["step"] == 1, error
        message = error["message"]
        assert "rank 1 was fed other micro-batches than rank 0 (both data index 0" in message
        assert "input_ids [0, 8]" in message  # rank 1's empty slice
        assert "elixir_tune.data_rank() and elixir_tune.data_size()" in message and "not RANK and WORLD_SIZE" in message


@pytest.mark.parametrize("index", [1, 3], ids=["tensor", "pipeline"])
def test_the_same_data_on_both_ranks_trains_as_plain_pytorch(results, index):
    per_rank = _ranks(results, index)
    assert all(result["error"] is None for result in per_rank), [r["error"] for r in per_rank]
    first = per_rank[0]
    assert first["loss_rel"] <= 1e-5 and first["weight_abs"] <= 1e-5, (first["loss_rel"], first["weight_abs"])
    assert per_rank[0]["losses"] == per_rank[1]["losses"]


@pytest.mark.parametrize("index", [4, 5, 6], ids=["data-nan-micro-batch", "pipeline-lr1e6", "tensor-bf16-lr1e6"])
def test_a_non_finite_step_stops_every_rank_at_that_step_with_finite_weights(results, index):
    per_rank = _ranks(results, index)
    errors = [result["error"] for result in per_rank]
    assert all(error is not None and error["type"] == "NonFiniteError" for error in errors), errors
    step = errors[0]["step"]
    assert all(error["step"] == step for error in errors)  # together: no rank left waiting in a collective
    if "nan_step" in per_rank[0]["case"]:
        assert step == per_rank[0]["case"]["nan_step"] + 1
        assert "a micro-batch loss not finite" in errors[0]["message"]
    dtype = per_rank[0]["case"].get("dtype", "fp32")
    assert all(f"optimizer step {step} (counted from 1) is not finite in {dtype}" in e["message"] for e in errors)
    assert all(result["finite"] and result["unchanged"] for result in per_rank)
