"""Tensor parallelism from each family's own transformers tensor plan (``config.base_model_tp_plan``,
translated into our table) against plain PyTorch: tensor 2 at world 2 (gloo, CPU), sequence
parallelism on, on the zoo's tiny models (tests/zoo/models.py: hidden 32, 2 layers, 4 heads with 2
key/value heads where the family groups them, vocabulary 128). One launch, 2 steps each: losses 1e-5
relative, final weights 1e-5 absolute, clipped gradient norms 1e-5 relative (fp32).

The families cover each style the engine runs: column/row-parallel linears (all), q | k | v fused per
head (GPT-NeoX), outputs gathered whole before the attention (Phi-3's fused q | k | v of unequal widths,
OLMo2's norm over all heads: ``colwise_gather`` / ``rowwise_split``), per-head norms with a gradient
summed over the tensor group (Qwen3's q_norm / k_norm: ``head_norm``), four norms per block (Gemma2,
whose head is tied to the embedding), a vocabulary-split embedding named in the plan (GPT-NeoX), an
output head with a bias and a parallel residual (GPT-J), scaled residuals (Granite), and the
mixture-of-experts styles (Qwen3-MoE and Mixtral: ``experts`` with packed gate | up and row-parallel
down, the router replicated; Qwen3-MoE for 6 steps, the other families 2).
"""

from __future__ import annotations

import pytest

from tests.distributed.tp_launches import tp_results

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FP32_LOSS_REL = 1e-5
FP32_WEIGHT_ABS = 1e-5
FAMILIES = ["qwen3", "gemma2", "gpt_neox", "phi3", "olmo2", "granite", "gptj", "qwen3_moe", "mixtral"]
STEPS = {"qwen3_moe": 6}
CHUNK_SIZE = {"mixtral": 8192}  # its fused experts hold 8192 elements
CASES = [
    dict(model=f"zoo:{name}", tensor=2, chunk_size=CHUNK_SIZE.get(name, 4096), clip=0.5, steps=STEPS.get(name, 2))
    for name in FAMILIES
]


@pytest.fixture(scope="module")
def world2():
    return tp_results("tensor_families", 2)  # one launch with test_engine_tensor_parallel.py's world 2


@pytest.mark.parametrize("index", range(len(CASES)), ids=FAMILIES)
def test_family_tensor2_matches_torch(world2, index):
    results = [rank_results[index] for rank_results in world2]
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
        assert result["layout_mismatches"] == [], (rank, result["layout_mismatches"])  # the search's shapes
        assert result["round_trip"], rank
        assert result["losses"] == results[0]["losses"]  # one tensor group computes one loss
    first = results[0]
    assert len(first["world_losses"]) == CASES[index]["steps"]
    assert first["loss_rel"] <= FP32_LOSS_REL, (first["case"], first["loss_rel"])
    assert first["weight_abs"] <= FP32_WEIGHT_ABS, (first["case"], first["weight_abs"])
    assert first["norm_rel"] <= FP32_LOSS_REL, (first["case"], first["norm_rel"])
