"""The search over pipeline and tensor parallelism: pins, choosing them only when faster, and the
plans it builds (chunks per stage at tensor-parallel local sizes)."""

from __future__ import annotations

import math

import pytest

from elixir_tune.costmodel.parallel import DATA_ONLY, Layout
from elixir_tune.costmodel.stage_profile import rank_profile
from elixir_tune.costmodel.synthetic import example_hardware, gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.plan import dump_plan, validate
from elixir_tune.plan.stages import assign_stages
from elixir_tune.plan.tensor_layout import local_shape
from elixir_tune.search import search
from elixir_tune.search.layouts import layout_choices


def profile_of(hidden: int, layers: int, heads: int, seq: int, vocab: int = 50304):
    return gpt2_profile("p", hidden=hidden, layers=layers, heads=heads, vocab=vocab, positions=seq, seq_len=seq)


@pytest.fixture(scope="module")
def small():
    return profile_of(256, 4, 4, 128, vocab=1024)


@pytest.fixture(scope="module")
def h100():
    return load_hardware("h100-80gb-sxm")


@pytest.mark.parametrize(
    "fixed,layout",
    [
        (["pipeline=2"], (2, 1, "1d")),
        (["tensor=2"], (1, 2, "1d")),
        (["tensor=4", "tensor_mode=2d"], (1, 4, "2d")),
        (["tensor_mode=2d"], (1, 4, "2d")),
        (["pipeline=1", "tensor=1"], (1, 1, "1d")),
    ],
)
def test_pins_are_honoured(small, fixed, layout):
    result = search(small, example_hardware(gpus_per_node=4), gpus_per_node=4, fixed=fixed, loop="forward_backward")
    plan = result.plan
    assert (plan.parallel.pipeline.stages, plan.parallel.tensor.degree, plan.parallel.tensor.mode) == layout
    assert all(c.layout == result.candidates[0].layout for c in result.candidates)
    assert validate(plan) == []
    assert plan.data_parallel_size == 4 // (layout[0] * layout[1])
    if layout[2] == "2d":  # each micro-batch splits over the q = 2 rows of the grid
        assert all(c.shape.micro_batch_size % 2 == 0 for c in result.candidates)


def test_a_pinned_contiguous_assignment_runs_one_run_of_blocks_per_stage(small):
    # A peer's 1F1B pipeline (one run of consecutive blocks per stage) pinned as such: the plan says
    # contiguous, and the bubble is GPipe's (P - 1) / (N + P - 1), not the modular split's smaller one.
    hardware = example_hardware(gpus_per_node=4)
    pins = ["pipeline=2", "tensor=1", "micro_batch_size=1", "checkpointing=none", "cache_blocks=all"]
    fb = {"gpus_per_node": 4, "global_batch_size": 8, "loop": "forward_backward"}
    contiguous = search(small, hardware, fixed=[*pins, "assignment=contiguous"], **fb)
    modular = search(small, hardware, fixed=pins, **fb)
    assert contiguous.plan.parallel.pipeline.assignment == "contiguous"
    assert modular.plan.parallel.pipeline.assignment == "modular"
    assert validate(contiguous.plan) == []
    best = contiguous.candidates[0]
    assert best.layout == Layout(pipeline=2, assignment="contiguous")
    accum = best.shape.grad_accum_steps
    bubble_s = best.estimate.breakdown["pipeline_bubble_s"]
    # busy x f / (1 - f) with f = 1 / (N + 1): the stage's compute over N
    assert bubble_s == pytest.approx(best.estimate.breakdown["compute_s"] / accum, rel=0.05)
    assert bubble_s > modular.candidates[0].estimate.breakdown["pipeline_bubble_s"]
    # Data parallelism only ignores the pin (no stages to assign blocks to).
    unpiped = search(small, hardware, fixed=[*pins[1:], "pipeline=1", "assignment=contiguous"], **fb)
    assert unpiped.candidates[0].layout == DATA_ONLY
    with pytest.raises(ValueError, match="expected one of modular, contiguous"):
        search(small, hardware, fixed=["assignment=round_robin"], **fb)


@pytest.mark.parametrize(
    "fixed,message",
    [
        (["tensor=3"], "does not divide the 4 GPUs of a node"),
        (["tensor=8"], "does not divide the 4 GPUs"),
        (["tensor=2", "tensor_mode=2d"], "square degree"),
        (["pipeline=8"], "4 repeated blocks; a stage needs at least one"),
        (["pipeline=3"], "the layout pins pipeline=3 leave no layout of the world of"),
        (["pipeline=2", "accumulation=standard"], "breadth-first"),
    ],
)
def test_bad_pins_say_why(small, fixed, message):
    with pytest.raises(ValueError, match=message):
        search(small, example_hardware(gpus_per_node=4), gpus_per_node=4, fixed=fixed, loop="forward_backward")


def test_sequence_parallelism_needs_the_degree_to_divide_the_tokens():
    odd_seq = profile_of(256, 4, 4, 126, vocab=1024)
    with pytest.raises(ValueError, match="126 tokens of a sample by T, and 4 does not divide them"):
        search(odd_seq, example_hardware(gpus_per_node=4), gpus_per_node=4, fixed=["tensor=4"], loop="forward_backward")
    allowed = {
        (layout.tensor, layout.tensor_mode)
        for layout in search(
            odd_seq, example_hardware(gpus_per_node=4), gpus_per_node=4, loop="forward_backward"
        ).models
    }
    assert (2, "1d") in allowed and (4, "1d") not in allowed and (4, "2d") in allowed


def test_models_without_a_tensor_layout_get_no_tensor_parallelism(small):
    odd_vocab = profile_of(256, 4, 4, 128, vocab=1023)  # the vocabulary does not split by 2
    with pytest.raises(ValueError, match="does not split evenly"):
        search(
            odd_vocab, example_hardware(gpus_per_node=4), gpus_per_node=4, fixed=["tensor=2"], loop="forward_backward"
        )
    result = search(odd_vocab, example_hardware(gpus_per_node=4), gpus_per_node=4, loop="forward_backward")
    assert all(layout.tensor == 1 for layout in result.models)


@pytest.mark.parametrize(
    "hidden,layers,heads,seq,batch,fixed,winner",
    [
        # compute-bound: data parallelism alone wins, the pipelines it tried are slower
        (1024, 8, 16, 4096, 64, [], DATA_ONLY),
        # short sequences, many micro-batches: modular pipeline 2 halves each rank's chunk traffic, but
        # its last stage also runs the 50304-word head and loss, and the step waits for the slowest stage
        (1024, 8, 16, 1024, 64, [], DATA_ONLY),
        # long sequences of a wide model: tensor 2 halves the activations (less recomputation)
        (8192, 4, 64, 8192, 8, ["pipeline=1"], Layout(tensor=2)),
    ],
)
def test_a_parallel_layout_only_when_faster(h100, hidden, layers, heads, seq, batch, fixed, winner):
    profile = profile_of(hidden, layers, heads, seq)
    result = search(profile, h100, gpus_per_node=8, global_batch_size=batch, fixed=fixed, loop="forward_backward")
    best = result.candidates[0]
    assert best.layout == winner
    others = {layout: c.step_time_s for layout, c in result.best_by_layout.items() if layout != winner}
    assert others, "other layouts were scored"
    assert all(step > best.step_time_s for step in others.values())
    # the why-line says how much slower data parallelism alone (or the best other layout) is
    assert "data parallelism only" in result.why and "slower" in result.why


def test_pipeline_with_2d_tensor_pins_is_searched(small):
    result = search(
        small,
        example_hardware(gpus_per_node=8),
        gpus_per_node=8,
        fixed=["pipeline=2", "tensor=4", "tensor_mode=2d"],
        loop="forward_backward",
    )
    assert result.candidates[0].layout == Layout(pipeline=2, tensor=4, tensor_mode="2d")


def test_search_scores_pipeline_by_tensor_layouts(small):
    """The combined layouts are candidates (1d, and 2d on a square degree), each scored with its data degree."""
    tried = layout_choices(small, gpus_per_node=8, nodes=1, global_batch_size=8, fixed={})
    combined = {
        (layout.pipeline, layout.tensor, layout.tensor_mode)
        for layout in tried
        if layout.pipeline > 1 and layout.tensor > 1
    }
    # P x T <= 8 with P <= 4 blocks, T dividing the 4 heads; T = 4 also as a 2 x 2 grid
    assert combined == {(2, 2, "1d"), (2, 4, "1d"), (2, 4, "2d"), (4, 2, "1d")}
    result = search(small, example_hardware(gpus_per_node=8), gpus_per_node=8, loop="forward_backward")
    assert Layout(pipeline=2, tensor=2) in result.best_by_layout
    # pp2 x tp2 pays both: the tensor collectives of its stage's blocks and the pipeline's bubble and sends
    parts = result.best_by_layout[Layout(pipeline=2, tensor=2)].estimate.breakdown
    assert parts["tensor_comm_s"] > 0 and parts["pipeline_bubble_s"] > 0 and parts["p2p_s"] > 0
    # a rank holds its stage's parameters at tensor-parallel width: about a quarter of the model here
    whole = sum(math.prod(p.shape) for p in small.params)
    for stage in (0, 1):
        held = sum(math.prod(p.shape) for p in rank_profile(small, Layout(pipeline=2, tensor=2), stage).params)
        assert whole / 5 < held < whole / 3, (stage, held, whole)


@pytest.mark.parametrize(("stages", "tensor"), [(2, 1), (1, 2), (2, 2)])
def test_plan_packs_each_stage_at_local_sizes(small, stages, tensor):
    fixed = [f"pipeline={stages}", f"tensor={tensor}"]
    result = search(small, example_hardware(gpus_per_node=8), gpus_per_node=8, fixed=fixed, loop="forward_backward")
    plan = result.plan
    assert validate(plan) == []
    assert plan.model.model_type == "gpt2" and plan.model.num_heads == 4 and plan.model.num_kv_heads == 4
    names = [p.name for p in small.params]
    stage_of = assign_stages(names, small.block_list, len(small.blocks), stages, "modular")
    listed = [name for chunk in plan.memory.chunks for name in chunk.params]
    assert sorted(listed) == sorted(names)  # every parameter once, the tied wte in the first stage
    shapes = {p.name: p.shape for p in small.params}
    for chunk in plan.memory.chunks:
        assert {stage_of[name] for name in chunk.params} == {chunk.stage}  # chunks never cross stages
        local = [math.prod(local_shape(name, shapes[name], "gpt2", tensor)) for name in chunk.params]
        assert sum(local) <= chunk.numel < sum(local) + 64 * len(local)  # local numels (plus alignment)
    assert {chunk.stage for chunk in plan.memory.chunks} == set(range(stages))
    text = dump_plan(plan)
    assert "parallel:" in text and ("stage: 1" in text) == (stages > 1)


def test_plans_without_parallelism_read_as_before(small):
    plan = search(
        small,
        example_hardware(gpus_per_node=2),
        gpus_per_node=2,
        fixed=["pipeline=1", "tensor=1"],
        loop="forward_backward",
    ).plan
    text = dump_plan(plan)
    assert "stage:" not in text and "parallel:" not in text


def test_elixir_baseline_has_neither(small):
    result = search(small, example_hardware(gpus_per_node=4), gpus_per_node=4, strategy="elixir")
    assert result.plan.parallel.is_default()
    with pytest.raises(ValueError, match="Elixir's rule has no pipeline"):
        search(
            small,
            example_hardware(gpus_per_node=4),
            gpus_per_node=4,
            strategy="elixir",
            fixed=["tensor=2"],
            loop="forward_backward",
        )


def test_a_global_batch_smaller_than_the_world_splits_sequences_or_names_every_pin(small):
    """Issue 48: a global batch of 1 on 2 GPUs was written as micro 1 x world 2."""
    hardware = example_hardware(gpus_per_node=2)
    result = search(small, hardware, gpus_per_node=2, global_batch_size=1)
    layout = result.candidates[0].layout
    assert (layout.context, result.plan.data_parallel_size) == (2, 1)  # each sequence split, one data share
    with pytest.raises(ValueError, match=r"pins pipeline=1, tensor=1, context=1 leave no layout .* global batch 1"):
        search(small, hardware, gpus_per_node=2, global_batch_size=1, fixed=["context=1"])
