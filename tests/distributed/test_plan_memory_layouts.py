"""A plan's memory is a promise, under every layout: each rank's ``memory_report()`` (the model-state
and transient bytes the engine allocated) equals, to the byte, what the plan file promises that
rank (``Plan.rank_memory``: its pipeline stage's entry of ``prediction.stages``, the prediction's
own figures without a pipeline), before and after a training step; and a pipeline step really held
the gradients the report says (``memory_stats()["peak_held_grad_bytes"]``).

Tiny causal LMs (hidden 32, 4 blocks, vocabulary 128, sequence 16) profiled from their YAML, plans
from the default search with the layout pinned (``loop="forward_backward"``), saved and read back:
the test checks what a user's plan file says. Stages hold different chunks, cache slots (the
engine caps the plan's ``cache_blocks`` at a stage's cacheable chunks, as the search's
``stage_shape`` does), held gradients and, with a tied head, the embedding on both stages.

* world 2: GPT-2 on 2 modular stages (tied ``wte`` on both), Llama on 2 contiguous stages with half
  of the shards offloaded, Qwen2 (tied head) LoRA on 2 stages (frozen chunks), GPT-2 tensor 2 (1d)
  with offload and 2 cache blocks, Qwen2-MoE expert 2.
* world 4: pipeline 2 x tensor 2 (Llama), pipeline 2 x data 2 with offload (Qwen2), tensor 4 in 2d
  on a 2 x 2 grid (GPT-2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SEQ = 16
VOCAB = 128
GQA = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ)  # fmt: skip
FAMILIES = {
    "gpt2": dict(n_embd=32, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=SEQ),
    "llama": dict(GQA, tie_word_embeddings=False),
    "qwen2": dict(GQA, tie_word_embeddings=True),
    "qwen2_moe": dict(GQA, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, decoder_sparse_step=1),
}  # fmt: skip
LORA = dict(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])

# (family, pins, micro-batch, global batch, LoRA)
WORLD2 = [
    ("gpt2", dict(pipeline=2, assignment="modular"), 2, 8, None),
    ("llama", dict(pipeline=2, assignment="contiguous", offload=0.5), 2, 8, None),
    ("qwen2", dict(pipeline=2), 2, 8, LORA),
    ("gpt2", dict(tensor=2, offload=0.5, cache_blocks=2), 2, 4, None),
    ("qwen2_moe", dict(expert=2), 2, 4, None),
]
WORLD4 = [
    ("llama", dict(pipeline=2, tensor=2), 2, 8, None),
    ("qwen2", dict(pipeline=2, tensor=1, offload=0.5), 2, 16, None),
    ("gpt2", dict(tensor=4, tensor_mode="2d"), 2, 2, None),
]


def make_cases(rows: list, world: int, tmp: Path) -> list[dict]:
    """Profiles each model, searches its plan with the layout pinned, saves it; the workers' cases."""
    from elixir_tune.hardware import load_hardware
    from elixir_tune.plan import save_plan
    from elixir_tune.profiler import profile_model
    from elixir_tune.profiler.source import quiet_transformers
    from elixir_tune.search import search

    hardware = load_hardware("cpu")
    cases = []
    for index, (family, pins, micro, global_batch, lora) in enumerate(rows):
        model_path = tmp / f"{family}.yaml"
        config = {"name": f"{family}-tiny", "architecture": family, "seq_len": SEQ, "config": FAMILIES[family]}
        model_path.write_text(yaml.safe_dump(config))
        with quiet_transformers():
            profile = profile_model(str(model_path), batch_size=micro, seq_len=SEQ, lora=lora)
        fixed = dict(pins, micro_batch_size=micro)
        result = search(profile, hardware, world, global_batch_size=global_batch, fixed=fixed, loop="forward_backward")
        plan_path = tmp / f"plan{world}-{index}.yaml"
        save_plan(result.plan, plan_path)
        cases.append(dict(model=str(model_path), plan=str(plan_path), lora=lora, label=f"{family} {pins}"))
    return cases


def run(rows: list, world: int, tmp: Path) -> list[list[dict]]:
    return launch("plan_memory_layouts_worker.py", make_cases(rows, world, tmp), world, timeout_s=600)


def check(results: list[list[dict]]) -> None:
    """Every rank's report equals its promise, before and after a step; a pipeline step held what
    the report says it holds."""
    from elixir_tune.plan import load_plan

    differ = []
    for rank, per_case in enumerate(results):
        for result in per_case:
            assert result["ok"], (rank, result.get("case"), result.get("error"), result.get("trace"))
            case = result["case"]
            plan = load_plan(case["plan"])
            assert plan.stage_of_rank(rank) == result["stage"]
            promise = plan.rank_memory(rank)
            promised = {**promise.model_state_bytes, **promise.transient_bytes}
            for when in ("report_before", "report_after"):
                if result[when] != promised:
                    keys = sorted(
                        k for k in promised.keys() | result[when].keys() if promised.get(k) != result[when].get(k)
                    )
                    differ.append(f"{case['label']} rank {rank} (stage {result['stage']}) {when}: " + ", ".join(
                        f"{k} promised {promised.get(k)} reported {result[when].get(k)}" for k in keys))  # fmt: skip
            if plan.parallel.pipeline.stages > 1:
                assert plan.prediction is not None and len(plan.prediction.stages) == plan.parallel.pipeline.stages
                assert plan.prediction.peak_gpu_bytes == max(s.peak_gpu_bytes for s in plan.prediction.stages)
                assert result["peak_held_grad_bytes"] == result["report_after"]["held_grad_bytes"] > 0, case
    assert not differ, "\n".join(differ)


def test_each_rank_holds_what_the_plan_promises_at_world_2(tmp_path):
    results = run(WORLD2, 2, tmp_path)
    check(results)
    # The stages of a pipeline plan hold different amounts (else the per-stage promise would be moot).
    gpt2_pipeline = [per_case[0]["report_before"] for per_case in results]
    assert gpt2_pipeline[0] != gpt2_pipeline[1]


@pytest.mark.heavy  # 4 processes, 3 searches: pipeline x tensor's held gradients are checked at world 4 by test_engine_mesh3d.py
def test_each_rank_holds_what_the_plan_promises_at_world_4(tmp_path):
    check(run(WORLD4, 4, tmp_path))
