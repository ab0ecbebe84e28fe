"""Context parallelism (``parallel.context``, Ulysses) against plain PyTorch on the whole sequence:
gloo, CPU, real transformers GPT-2 and Llama (grouped-query attention: 4 heads, 2 key/value heads).

Context 2 at world 2 (every rank holds 8 of each sample's 16 tokens; attention exchanges heads by
all-to-all), and data 2 x context 2 at world 4: sdpa and eager attention, the plain loop and
``forward_backward``, right-padded rows (attention_mask 0, labels -100: every rank and micro-batch
counts different tokens), recomputed blocks and offloaded chunks. fp32: step losses 1e-5 relative,
final weights 1e-5 absolute after 4 AdamW steps (eps 1e-6, as the other engine tests).
"""

from __future__ import annotations

import pytest

from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FP32_LOSS_REL = 1e-5
FP32_WEIGHT_ABS = 1e-5
WORLD2 = [
    dict(model="gpt2", attn="eager", context=2, loop="plain"),
    dict(model="llama", attn="sdpa", context=2, loop="forward_backward", accum=2, checkpoint=1, padded=True),
    dict(model="gpt2", attn="sdpa", context=2, loop="plain", padded=True, offload=0.5, cache="min"),
    dict(model="llama", attn="eager", context=2, loop="plain", padded=True),
    dict(model="gpt2", attn="eager", context=2, loop="forward_backward", accum=2, padded=True, checkpoint=1),
]
# Last, as it leaves its model mid-forward: ranks fed by RANK instead of data_rank().
SLICED_BY_RANK = dict(model="llama", attn="sdpa", context=2, slice_by_rank=True)
WORLD4 = [
    dict(
        model="llama", attn="sdpa", context=2, loop="forward_backward", accum=2, padded=True, offload=0.5, cache="min"
    ),
    dict(model="gpt2", attn="eager", context=2, loop="plain"),
]


def check(per_rank: list[list[dict]], index: int, data: int) -> None:
    results = [rank_results[index] for rank_results in per_rank]
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
        # rank = data_index x C + context_index: a context group shares its data index.
        assert (result["data"], result["data_rank"]) == (data, rank // 2), rank
        if result["case"]["loop"] == "plain":
            assert result["logits_len"] == 8, rank  # each rank's logits cover its half of the sequence
    first = results[0]
    assert first["loss_rel"] <= FP32_LOSS_REL, (first["case"], first["loss_rel"])
    assert first["weight_abs"] <= FP32_WEIGHT_ABS, (first["case"], first["weight_abs"])


@pytest.fixture(scope="module")
def world2():
    return launch("context_parallel_worker.py", [*WORLD2, SLICED_BY_RANK], 2, timeout_s=400)


@pytest.mark.parametrize("index", range(len(WORLD2)), ids=[str(c) for c in WORLD2])
def test_context2_world2_matches_torch(world2, index):
    check(world2, index, data=1)


def test_data2_context2_world4_matches_torch():
    per_rank = launch("context_parallel_worker.py", WORLD4, 4, timeout_s=400)
    for index in range(len(WORLD4)):
        check(per_rank, index, data=2)


def test_ranks_of_a_context_group_fed_different_rows_are_stopped(world2):
    for rank, rank_results in enumerate(world2):
        error = rank_results[len(WORLD2)].get("contract_error")
        assert error and "context ranks [1] got other inputs" in error and "data_rank()" in error, (rank, error)
