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
PIPELINE_1F1B = dict(pipeline=2, assignment="contiguous", schedule="1f1b")
WORLD2 = [
    ("gpt2", dict(pipeline=2, assignment="modular"), 2, 8, None),
    ("llama", dict(pipeline=2, assignment="contiguous", offload=0.5), 2, 8, None),
    ("qwen2", dict(pipeline=2), 2, 8, LORA),
    ("gpt2", dict(tensor=2, offload=0.5, cache_blocks=2), 2, 4, None),
    ("qwen2_moe", dict(expert=2), 2, 4, None),
    ("gpt2", PIPELINE_1F1B, 2, 8, None),
    ("llama", PIPELINE_1F1B, 2, 8, None),
]
# Measured (``memory_probe``) at world 2, each after the rows above: 2 contiguous stages, 8 micro-batches of
# 2, under the looped breadth-first schedule (every stage holds 8 micro-batches' activations) and 1F1B
# (stage 0 at most 2, stage 1 one).
SCHEDULES = ("looped_bfs", "1f1b")
MAX_OVER = 1.15  # the prediction at most this far above the measured peak (test_memory_fidelity.py's bound)
# (family, schedule, stage) measured above the promise (``check_measured_peaks``), and how far at most.
UNDER: set[tuple[str, str, int]] = set()
UNDER_LEAST = 0.99  # and no stage more than 1% under its promise
MEASURED = [
    (family, dict(pipeline=2, assignment="contiguous", schedule=schedule, checkpointing="none"), 2, 16, None)
    for family in ("gpt2", "llama")
    for schedule in SCHEDULES
]
WORLD4 = [
    ("llama", dict(pipeline=2, tensor=2), 2, 8, None),
    ("qwen2", dict(pipeline=2, tensor=1, offload=0.5), 2, 16, None),
    ("gpt2", dict(tensor=4, tensor_mode="2d"), 2, 2, None),
]


def make_cases(rows: list, world: int, tmp: Path, measure: bool = False) -> list[dict]:
    """Profiles each model, searches its plan with the layout pinned, saves it; the workers' cases
    (``measure``: each also measures its step's peak)."""
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
        plan_path = tmp / f"plan{world}-{'measured-' if measure else ''}{index}.yaml"
        save_plan(result.plan, plan_path)
        case = dict(model=str(model_path), plan=str(plan_path), lora=lora, label=f"{family} {pins}")
        cases.append(dict(case, measure=True) if measure else case)
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
    cases = make_cases(WORLD2, 2, tmp_path) + make_cases(MEASURED, 2, tmp_path, measure=True)
    results = launch("plan_memory_layouts_worker.py", cases, 2, timeout_s=600)
    check(results)
    # The stages of a pipeline plan hold different amounts (else the per-stage promise would be moot).
    gpt2_pipeline = [per_case[0]["report_before"] for per_case in results]
    assert gpt2_pipeline[0] != gpt2_pipeline[1]
    check_measured_peaks(results)


def check_measured_peaks(results: list[list[dict]]) -> None:
    """Each measured rank's peak against its stage's promise (device peak plus the rank's share of the
    node's host peak: on a CPU device one pool): at most ``MAX_OVER`` above it and, where covered, at
    least the measured peak; and stage 0 under 1F1B is predicted and measured below stage 0 under the
    looped breadth-first schedule.

    Not covered (``UNDER``, pinned where it is so that a new gap shows): none; every stage is predicted
    1.003-1.134x of its measured peak. Three terms closed the gaps this test used to pin (GPT-2's stages
    0.88-0.96x under both schedules, Llama's 0.99x under 1F1B): what GPT-2's attention keeps on a CPU
    device (its ``attn_pdrop``, 0.1 here, sends torch's CPU attention down its math path, 14 bytes per
    score element: ``memory.cpu_attention_dropout_bytes``), the receive buffers torch's ``PipelineStage``
    allocates for every micro-batch (``stage_profile.recv_buffer_bytes``), and the activations live
    before the first block (the profile's ``prologue_bytes_per_sample``), which the first stage holds
    (block 0's input leaves the last stage's figure)."""
    from elixir_tune.plan import load_plan

    rows: list[tuple[str, int, int, int]] = []
    under: list[tuple[tuple[str, str, int], int, int]] = []
    stage0: dict[tuple[str, str], tuple[int, int]] = {}
    for rank, per_case in enumerate(results):
        for result in per_case:
            if not result["case"].get("measure"):
                continue
            plan = load_plan(result["case"]["plan"])
            promise = plan.rank_memory(rank)
            predicted = promise.peak_gpu_bytes + promise.peak_host_bytes // plan.cluster.gpus_per_node
            measured = result["measured"]["peak_bytes"]
            rows.append((result["case"]["label"], rank, measured, predicted))
            family, schedule = result["case"]["label"].split()[0], plan.parallel.pipeline.schedule
            under.append(((family, schedule, result["stage"]), measured, predicted))
            if result["stage"] == 0:
                stage0[family, schedule] = (measured, predicted)
    table = "\n".join(f"{label} rank {rank}: measured {m} predicted {p} ({p / m:.3f}x)" for label, rank, m, p in rows)
    print(table)  # pytest -s shows the figures
    assert len(rows) == 2 * len(MEASURED), table
    assert all(p <= MAX_OVER * m for _, _, m, p in rows), table
    assert {key for key, m, p in under if p < m} <= UNDER, table
    assert all(p >= UNDER_LEAST * m for _, _, m, p in rows), table
    for family in ("gpt2", "llama"):
        (looped_m, looped_p), (f1b_m, f1b_p) = (stage0[family, schedule] for schedule in SCHEDULES)
        assert f1b_p < looped_p and f1b_m < looped_m, table


@pytest.mark.heavy  # 4 processes, 3 searches: pipeline x tensor's held gradients are checked at world 4 by test_engine_mesh3d.py
def test_each_rank_holds_what_the_plan_promises_at_world_4(tmp_path):
    check(run(WORLD4, 4, tmp_path))
