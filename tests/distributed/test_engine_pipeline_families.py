"""Pipeline stages for every family that runs on them (plan/capabilities.py PIPELINE_MODEL_TYPES: those
whose transformers config ships ``base_model_pp_plan``, and GPT-2 and OPT from our tables) against plain
PyTorch, and padded micro-batches of different lengths.

A tiny causal LM per family (``tests/unit/models/stage_families.py``: grouped-query attention,
sliding windows, Gemma2's soft-capped logits, Granite's multipliers, the fused experts of Qwen3-MoE
and Mixtral, DeepSeek-V3's latent attention and its dense-then-MoE blocks, tied heads for GPT-2, OPT
and Qwen2), 3 blocks on 2 stages (modular: the middle block on stage 1 between two of stage 0's),
4 micro-batches of 2 per step, 2 steps, one launch of world 2. fp32: losses 1e-5 relative, weights
1e-5 absolute. The padded cases feed micro-batches of lengths 8, 5, 8, 6 with a padding mask each and
compare with plain PyTorch running them unpadded one by one.
"""

from __future__ import annotations

import pytest

from elixir_tune.models.stage_plans import HAND_PLANS
from elixir_tune.plan.capabilities import PIPELINE_MODEL_TYPES
from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LOSS_REL = 1e-5
WEIGHT_ABS = 1e-5
STEPS = 2
PADDED = ("llama", "gemma2", "opt", "qwen3_moe", "gpt2")
CASES = [dict(family=family, steps=STEPS) for family in PIPELINE_MODEL_TYPES] + [
    dict(family=family, steps=STEPS, padded=True) for family in PADDED
]


def case_id(case: dict) -> str:
    return case["family"] + ("-padded" if case.get("padded") else "")


@pytest.fixture(scope="module")
def results():
    return launch("engine_pipeline_families_worker.py", CASES, 2, timeout_s=900)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_family_on_two_stages_matches_torch(results, index):
    per_rank = [rank_results[index] for rank_results in results]
    for rank, result in enumerate(per_rank):
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
    case, first = CASES[index], per_rank[0]
    assert first["loss_rel"] <= LOSS_REL, (case, first["loss_rel"], first["losses"], first["reference_losses"])
    assert first["weight_abs"] <= WEIGHT_ABS, (case, first["weight_abs"])
    # Stage 0 runs blocks 0 and 2 (the embeddings and the head), stage 1 block 1; both return the loss.
    assert [r["virtual"] for r in per_rank] == [[[0], [2]], [[1]]]
    assert per_rank[0]["losses"] == per_rank[1]["losses"]
    expected = "elixir-tune table" if case["family"] in HAND_PLANS else "transformers base_model_pp_plan"
    assert first["source"] == expected
