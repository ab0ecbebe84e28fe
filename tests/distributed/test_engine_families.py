"""The engine on the model families beyond GPT-style LMs, against plain PyTorch on the same global
batch (gloo, CPU, world size 2, real processes): BART and T5 (encoder-decoder; T5's relative
position bias is computed by each stack's first block and shared with the others), Qwen2-MoE
(transformers' fused experts, 4 experts top-2, a shared expert) and a ViT image classifier.

Each plan comes from the real profiler and search: the smallest cache, half the shards offloaded,
every block checkpointed. In the MoE case rank 1's batch is one repeated token, so all its tokens
route to the same two experts in the first layer while rank 0's use all four: the collectives must
stay in step although the ranks' expert work differs.

Tolerances as in test_engine_archs.py: losses 1e-5 relative, final weights 1e-5 absolute (fp32).
"""

from __future__ import annotations

import pytest

from tests.distributed.engine_launch import launch

LOSS_REL = 1e-5
WEIGHT_ABS = 1e-5
STEPS = 3

CASES = [
    dict(family="bart", steps=STEPS, global_batch=8),
    dict(family="t5", steps=STEPS, global_batch=8),
    dict(family="moe", steps=STEPS, global_batch=8, one_token_rank=1),
    dict(family="vit", steps=STEPS, global_batch=8),
]

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def world2():
    return launch("engine_families_worker.py", CASES, 2, timeout_s=300)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case["family"] for case in CASES])
def test_family_matches_torch(world2, index):
    results = [rank_results[index] for rank_results in world2]
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
    first = results[0]
    plan = first["plan"]
    assert plan["offloaded"] > 0 and plan["checkpoint_every"] == 1, plan
    assert plan["cache_blocks"] < plan["chunks"] - plan["resident"], plan
    assert len(first["world_losses"]) == STEPS
    assert first["loss_rel"] <= LOSS_REL, first["loss_rel"]
    assert first["weight_abs"] <= WEIGHT_ABS, first["weight_abs"]


def test_moe_ranks_routed_differently(world2):
    index = next(i for i, case in enumerate(CASES) if case["family"] == "moe")
    seen = [rank_results[index]["experts_seen"] for rank_results in world2]
    assert len(seen[1]) == 2 and len(seen[0]) == 4, seen
