"""2D (Optimus, 2 x 2 grid) tensor parallelism built from each family's own tensor plan against plain
PyTorch: tensor 4 at world 4 (gloo, CPU), on the zoo's tiny models (tests/zoo/models.py: hidden 32,
2 layers, 4 heads with 2 key/value heads, intermediate 64, vocabulary 128). One launch runs every
case, 2 steps each: losses 1e-5 relative, final weights 1e-5 absolute, clipped gradient norms 1e-5
relative (fp32). GPT-2 and Llama at 2D are in test_engine_tensor_parallel.py.

No family here has a hand-written grid plan: ``tp_grid.grid_plan`` derives each from the 1D styles
of the tensor table. The families cover what that rule meets beyond Llama: grouped-query attention
with per-head norms whose gradient is summed over the grid (Qwen3's q_norm / k_norm,
``head_norm``), outputs gathered over the grid columns and a fused q | k | v of unequal widths (Phi-3:
``colwise_gather`` / ``rowwise_split``), and a tied head with four norms per block and scaled
embeddings (Gemma2).
"""

from __future__ import annotations

import pytest

from tests.distributed.tp_launches import tp_results

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FP32_LOSS_REL = 1e-5
FP32_WEIGHT_ABS = 1e-5
FAMILIES = ["qwen3", "phi3", "gemma2"]
STEPS = 2
CASES = [dict(model=f"zoo:{name}", tensor=4, mode="2d", chunk_size=4096, clip=0.5, steps=STEPS) for name in FAMILIES]


@pytest.fixture(scope="module")
def world4():
    return tp_results("tensor_grid", 4)  # one launch with test_engine_tensor_parallel.py's world 4


@pytest.mark.parametrize("index", range(len(CASES)), ids=FAMILIES)
def test_family_grid_2x2_matches_torch(world4, index):
    results = [rank_results[index] for rank_results in world4]
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
        assert result["layout_mismatches"] == [], (rank, result["layout_mismatches"])  # the search's shapes
        assert result["round_trip"], rank
        assert result["losses"] == results[0]["losses"]  # one tensor group (the whole grid) computes one loss
    first = results[0]
    assert len(first["world_losses"]) == STEPS
    assert first["loss_rel"] <= FP32_LOSS_REL, (first["case"], first["loss_rel"])
    assert first["weight_abs"] <= FP32_WEIGHT_ABS, (first["case"], first["weight_abs"])
    assert first["norm_rel"] <= FP32_LOSS_REL, (first["case"], first["norm_rel"])
