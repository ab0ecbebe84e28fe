"""Fine-tuning's exits under pipeline plans: ``save_pretrained`` streams every stage's weights to rank 0
(engine/io/pretrained.py `save_stages`) and the recipes' evaluation runs the schedule's forwards only
(recipes/evaluation.py), both against plain PyTorch and transformers.

One launch of 4 processes, tiny causal LMs of 3 blocks (hidden 32) trained 2 steps on 2 stages:

* Llama, pipeline 2 x data 2, contiguous stages under 1f1b, files of at most 20 KB (several files and an index);
* GPT-2, pipeline 2 x data 2 (modular stages, as the next case, under looped_bfs), tied embedding and head on
  different stages, stored in bf16;
* Qwen2, pipeline 2 x tensor 2, tied embedding and head, each stage's pieces assembled over its tensor group.

Each directory loads with ``AutoModelForCausalLM.from_pretrained``; its files hold the tensor names plain
transformers writes for the model (the tied head once, under the embedding's name) in the stored dtype, every
tensor equal to the engine's merged ``state_dict()`` and within 1e-5 of plain PyTorch after the same steps (an
evaluation between the two steps changes nothing). The
evaluation loss (a split with a stand-in round, a batch without loss tokens, a padded one and a smaller last
batch) is plain PyTorch's on the written weights within 1e-5 relative, with the same token count, on every rank.
"""

from __future__ import annotations

import pytest

from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LOSS_REL = 1e-5
WEIGHT_ABS = 1e-5
CASES = [
    dict(family="llama", stages=2, steps=2, max_shard_size="20KB", assignment="contiguous", schedule="1f1b"),
    dict(family="gpt2", stages=2, steps=2, dtype="bfloat16"),
    dict(family="qwen2", stages=2, tensor=2, steps=2),
]
SAFETENSORS_NAME = {"F32": "BF16"}  # the stored dtype of an fp32 tensor saved in bf16


@pytest.fixture(scope="module")
def world4():
    return launch("pipeline_export_worker.py", CASES, 4, timeout_s=600)


def _ranks(results, index: int) -> list[dict]:
    per_rank = [rank_results[index] for rank_results in results]
    for rank, result in enumerate(per_rank):
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
    return per_rank


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["family"] for c in CASES])
def test_save_pretrained_under_a_pipeline_plan(world4, index):
    saved = _ranks(world4, index)[0]["saved"]
    case = CASES[index]
    plain = saved["plain_tensors"]
    if case.get("dtype") == "bfloat16":
        plain = {name: SAFETENSORS_NAME.get(kind, kind) for name, kind in plain.items()}
        assert saved["loaded_dtypes"] == ["torch.bfloat16"]
    else:
        assert saved["plain_diff"] <= WEIGHT_ABS, (case, saved["plain_diff"])
    assert saved["tensors"] == plain  # names and dtypes as transformers writes them (a tied head once)
    assert saved["missing"] == []
    assert saved["engine_diff"] == 0.0
    weights = [name for name in saved["files"] if name.endswith(".safetensors")]
    if case.get("max_shard_size"):
        assert len(weights) > 2 and saved["index_files"] == weights, saved["files"]
    else:
        assert weights == ["model.safetensors"] and saved["index_files"] == []
    assert "config.json" in saved["files"]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["family"] for c in CASES])
def test_evaluation_under_a_pipeline_plan(world4, index):
    per_rank = _ranks(world4, index)
    result = per_rank[0]["eval"]
    assert result["tokens"] == result["plain_tokens"] > 0
    assert abs(result["loss"] - result["plain_loss"]) <= LOSS_REL * result["plain_loss"], result
    assert all(r["eval"] == {"loss": result["loss"], "tokens": result["tokens"]} for r in per_rank[1:])
