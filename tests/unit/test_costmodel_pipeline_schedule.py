"""The pipeline schedule in the cost model and the search: what each stage holds under 1F1B and the
looped breadth-first schedule (``parallel.held_activation_copies``), the held gradients that do not
depend on it, the same bubble, and the search offering 1F1B only where ``schedule_problem`` runs it,
picking it where memory decides and keeping the breadth-first schedule on a tie (GPT-2, Llama, Qwen2
profiles of tiny transformers configs)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from elixir_tune.costmodel.memory import untraced_step_bytes
from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.costmodel.parallel import Layout, held_activation_copies
from elixir_tune.costmodel.synthetic import example_hardware
from elixir_tune.plan import validate
from elixir_tune.profiler import profile_model
from elixir_tune.search import search
from elixir_tune.search.layouts import schedule_choices

FAMILIES = {
    "gpt2": {"n_embd": 32, "n_layer": 4, "n_head": 2, "vocab_size": 128, "n_positions": 32},
    "llama": {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
              "intermediate_size": 64, "vocab_size": 128},
    "qwen2": {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
              "intermediate_size": 64, "vocab_size": 128},
}  # fmt: skip
# Everything but the chunk size and the pipeline's split pinned: one shape per layout.
PINS = {
    "pipeline": 2,
    "micro_batch_size": 1,
    "checkpointing": "none",
    "offload": 1.0,
    "prefetch": 0,
    "cache_blocks": "all",
    "dtype": "fp32",
}


@pytest.fixture(scope="module")
def profiles(tmp_path_factory) -> dict:
    import yaml

    tmp: Path = tmp_path_factory.mktemp("schedule")
    found = {}
    for family, config in FAMILIES.items():
        path = tmp / f"{family}.yaml"
        path.write_text(yaml.safe_dump({"name": f"{family}-tiny", "architecture": family, "config": config}))
        found[family] = profile_model(str(path), batch_size=2, seq_len=32)
    return found


def test_held_activation_copies():
    # 1F1B: stage s of P holds at most P - s micro-batches, never more than the step has.
    assert [held_activation_copies("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [held_activation_copies("1f1b", 4, s, 2) for s in range(4)] == [2, 2, 2, 1]
    # Breadth-first schedules hold every micro-batch on every stage; interleaved 1F1B is priced so too.
    for schedule in ("looped_bfs", "gpipe", "interleaved_1f1b"):
        assert [held_activation_copies(schedule, 4, s, 8) for s in range(4)] == [8] * 4
    assert held_activation_copies("1f1b", 1, 0, 8) == 8  # no pipeline: the caller's rule


def test_schedule_choices_follow_schedule_problem():
    # 4 blocks on 2 stages, modular: two runs per rank, which 1F1B cannot run.
    assert schedule_choices(4, 2, {}) == [("modular", "looped_bfs")]
    # One block per stage, or one run per stage: 1F1B beside the breadth-first schedule.
    assert schedule_choices(4, 4, {}) == [("modular", "looped_bfs"), ("modular", "1f1b")]
    both = [("contiguous", "looped_bfs"), ("contiguous", "1f1b")]
    assert schedule_choices(4, 2, {"assignment": "contiguous"}) == both
    assert schedule_choices(4, 2, {"assignment": "contiguous", "schedule": "1f1b"}) == [("contiguous", "1f1b")]
    assert schedule_choices(4, 2, {"schedule": "1f1b"}) == []  # modular: the search says why
    assert schedule_choices(4, 1, {}) == [("modular", "looped_bfs")]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_stage_holds_what_its_schedule_keeps(profiles, family):
    profile = profiles[family]
    hardware = example_hardware(gpus_per_node=2)
    looped = Layout(pipeline=2, assignment="contiguous")
    one_f_one_b = replace(looped, schedule="1f1b")
    chunk = 1 << 16
    one = Shape(chunk, 1, 0, 0, 0, 2, 1, layered=False)
    several = Shape(chunk, 1, 0, 0, 0, 2, 4, layered=True)
    for stage in (0, 1):
        models = {
            name: CostModel(profile, hardware, 2, dtype="fp32", layout=layout, stage=stage)
            for name, layout in (("looped", looped), ("1f1b", one_f_one_b))
        }
        copy_bytes = models["looped"].memory(one).activation_bytes
        assert copy_bytes > 0
        looped_memory, f1b_memory = (models[name].memory(several) for name in ("looped", "1f1b"))
        assert looped_memory.activation_bytes == 4 * copy_bytes
        assert f1b_memory.activation_bytes == (2 - stage) * copy_bytes
        # The stage's gradients are held unsharded across the micro-batches under either schedule.
        held = looped_memory.transient_bytes["held_grad_bytes"]
        assert held > 0 and f1b_memory.transient_bytes["held_grad_bytes"] == held
        # ... and each held micro-batch's tokens and saved generator states (costmodel/memory.py)
        stage_profile, mb, every = models["looped"].profile, several.micro_batch_size, several.every
        per_copy = untraced_step_bytes(stage_profile, mb, every, 2) - untraced_step_bytes(stage_profile, mb, every, 1)
        assert looped_memory.peak_gpu_bytes - f1b_memory.peak_gpu_bytes == (2 + stage) * (copy_bytes + per_copy)
        # One run of blocks per stage under both: GPipe's bubble, the same step.
        times = [models[name].step_time(several) for name in ("looped", "1f1b")]
        assert times[0].step_time_s == times[1].step_time_s
        assert times[0].breakdown["pipeline_bubble_s"] == times[1].breakdown["pipeline_bubble_s"] > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_search_keeps_breadth_first_on_a_tie_and_picks_1f1b_where_memory_decides(profiles, family):
    profile = profiles[family]
    hardware = example_hardware(gpus_per_node=2)
    pins = {**PINS, "assignment": "contiguous"}
    arguments = dict(gpus_per_node=2, global_batch_size=8, loop="forward_backward", top_k=10)
    roomy = search(profile, hardware, fixed=pins, **arguments)
    assert roomy.plan.parallel.pipeline.schedule == "looped_bfs"
    by_schedule = {c.layout.schedule: c for c in roomy.candidates}
    looped, f1b = by_schedule["looped_bfs"], by_schedule["1f1b"]
    assert looped.shape == f1b.shape and looped.step_time_s == f1b.step_time_s  # a tie: breadth-first kept
    # Every micro-batch (8) on stage 0 against at most P = 2 under 1F1B.
    assert f1b.memory.required_gpu_bytes < looped.memory.required_gpu_bytes
    # A device between the two: only 1F1B fits, and the plan carries it with its per-stage promise.
    budget = (f1b.memory.required_gpu_bytes + looped.memory.required_gpu_bytes) // 2
    pins["chunk_size"] = roomy.plan.memory.chunk_size
    tight = search(profile, hardware, fixed=pins, device_memory_bytes=budget, **arguments)
    plan = tight.plan
    assert plan.parallel.pipeline.schedule == "1f1b" and plan.parallel.pipeline.assignment == "contiguous"
    assert plan.training.grad_accum_steps == 8
    validate(plan)
    assert plan.prediction is not None
    stages = plan.prediction.stages
    assert [s.stage for s in stages] == [0, 1]
    assert stages[0].peak_gpu_bytes < roomy.plan.prediction.stages[0].peak_gpu_bytes
    assert plan.rank_memory(0).peak_gpu_bytes == stages[0].peak_gpu_bytes
    # Pinned modular on 4 blocks: 1F1B cannot run that split; the search says why.
    with pytest.raises(ValueError, match="1f1b runs one virtual stage per rank"):
        search(profile, hardware, fixed={**PINS, "assignment": "modular", "schedule": "1f1b"}, **arguments)


def test_free_search_offers_1f1b_where_the_modular_split_runs_it(profiles):
    """4 blocks on 4 stages: the modular split is one block per stage, 1F1B runs it; on 2 stages it
    does not, and the search offers the breadth-first schedule only."""
    profile = profiles["qwen2"]
    arguments = dict(global_batch_size=16, loop="forward_backward", top_k=20)
    four = search(
        profile, example_hardware(gpus_per_node=4), gpus_per_node=4, fixed={**PINS, "pipeline": 4}, **arguments
    )
    schedules = {c.layout.schedule for c in four.candidates}
    assert schedules == {"looped_bfs", "1f1b"}, schedules
    assert four.plan.parallel.pipeline.schedule == "looped_bfs"  # the same step: breadth-first kept
    assert all(c.shape.grad_accum_steps >= 4 for c in four.candidates if c.layout.schedule == "1f1b")
    two = search(profile, example_hardware(gpus_per_node=2), gpus_per_node=2, fixed=PINS, **arguments)
    assert {c.layout.schedule for c in two.candidates} == {"looped_bfs"}
    # 1F1B pinned on a step of one micro-batch: the search says what to change.
    with pytest.raises(ValueError, match="needs at least 2 micro-batches per step.*raise the global batch"):
        search(
            profile,
            example_hardware(gpus_per_node=2),
            gpus_per_node=2,
            global_batch_size=2,
            fixed={"pipeline": 2, "assignment": "contiguous", "schedule": "1f1b", "micro_batch_size": 2},
            loop="forward_backward",
        )
