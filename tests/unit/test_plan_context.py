"""``parallel.context`` in the plan: round trip, the data size it implies, byte-identical files
without it, and validate's refusals of what the engine does not run yet."""

from __future__ import annotations

import pytest

from elixir_tune.paths import CONFIGS_DIR
from elixir_tune.plan import load_plan, plan_from_dict, plan_to_dict, read_plan_dict, validate
from elixir_tune.plan.context import context_problems
from elixir_tune.plan.io import dump_plan
from elixir_tune.plan.schema import ContextParallel, TensorParallel
from elixir_tune.ranks import mesh_groups

EXAMPLE = CONFIGS_DIR / "plans" / "example.yaml"  # tiny GPT-2, world 2, 2 blocks


def _context_plan(degree: int = 2) -> dict:
    """The example plan at world 4 = data (4 / degree) x context ``degree``, a Llama's heads."""
    raw = read_plan_dict(EXAMPLE)
    raw["cluster"]["gpus_per_node"] = 4
    raw["model"].update(model_type="llama", num_heads=4, num_kv_heads=2)
    raw["parallel"] = {"context": {"degree": degree, "mode": "ulysses"}}
    training = raw["training"]
    training["global_batch_size"] = training["micro_batch_size"] * training["grad_accum_steps"] * (4 // degree)
    return raw


def test_context_round_trips_and_splits_the_world():
    raw = _context_plan()
    assert validate(raw) == []
    plan = plan_from_dict(raw)
    assert plan.parallel.context == ContextParallel(degree=2, mode="ulysses")
    assert (plan.data_parallel_size, plan.shard_group_size) == (2, 4)
    assert plan_to_dict(plan)["parallel"]["context"] == raw["parallel"]["context"]


def test_plans_without_context_are_written_as_before():
    plan = load_plan(EXAMPLE)
    assert "context" not in dump_plan(plan)
    plan.parallel.tensor = TensorParallel(degree=2)
    text = dump_plan(plan)
    assert "tensor:" in text and "context" not in text


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda raw: raw["parallel"].update(tensor={"degree": 2}),
            "x tensor degree 2 does not divide model.num_kv_heads 2",
        ),
        (lambda raw: raw["parallel"].update(tensor={"degree": 4, "mode": "2d"}), "with 2D tensor parallelism"),
        (lambda raw: raw["model"].update(num_kv_heads=3), "does not divide model.num_kv_heads 3"),
        (lambda raw: raw["model"].update(model_type="opt"), "not model_type 'opt'"),
        (lambda raw: raw["training"].update(seq_len=9), "training.seq_len: 9 is not a multiple of 2"),
        (lambda raw: raw["memory"].update(chunk_size=65538), "the data-parallel size 2 x context degree 2"),
        (lambda raw: raw["training"].update(accumulation="layered", loop="forward_backward"), "layered accumulation"),
    ],
)
def test_what_the_engine_cannot_run_is_refused(change, expected):
    raw = _context_plan()
    change(raw)
    problems = validate(raw)
    assert any(expected in problem for problem in problems), problems


def test_context_degree_must_divide_the_world():
    raw = _context_plan(degree=3)
    assert any(
        "context degree 3" in problem and "does not divide the world size 4" in problem for problem in validate(raw)
    )


@pytest.mark.parametrize("mode", ["allgather", "ring"])
def test_the_balanced_forms_take_any_head_count_and_need_2c_chunks(mode):
    raw = _context_plan()
    raw["parallel"]["context"]["mode"] = mode
    raw["model"].update(num_heads=4, num_kv_heads=1)
    assert validate(raw) == []
    raw["training"]["seq_len"] = 6  # two ranks' shares, but not four chunks
    problems = validate(raw)
    assert any("training.seq_len: 6 is not a multiple of 4" in problem for problem in problems), problems


@pytest.mark.parametrize("mode", ["allgather", "ring", "ulysses"])
def test_context_runs_beside_1d_tensor_parallelism(mode):
    raw = _context_plan()
    raw["model"].update(model_type="gpt2", num_kv_heads=4)  # GPT-2: a built-in tensor table
    raw["parallel"].update(tensor={"degree": 2}, context={"degree": 2, "mode": mode})
    raw["training"]["global_batch_size"] = raw["training"]["micro_batch_size"] * raw["training"]["grad_accum_steps"]
    assert validate(raw) == []


def test_show_lists_context_groups_tensor_degree_apart():
    from elixir_tune.cli.show import mesh_lines

    raw = _context_plan()
    raw["model"].update(model_type="gpt2", num_kv_heads=4)
    raw["parallel"].update(tensor={"degree": 2}, context={"degree": 2, "mode": "ring"})
    raw["training"]["global_batch_size"] = raw["training"]["micro_batch_size"] * raw["training"]["grad_accum_steps"]
    lines = mesh_lines(plan_from_dict(raw))
    # rank = (data_index x C + context_index) x T + tensor_index: chunks shard over data x context.
    assert (
        "context groups hold shares of the same sequences and exchange keys and values (2 ranks apart): [0,2] [1,3]"
        in lines
    )
    assert any(line.startswith("data groups") and line.endswith("[0,2] [1,3]") for line in lines), lines
    assert any(line.startswith("tensor groups") and line.endswith("[0,1] [2,3]") for line in lines), lines


def test_pipeline_stages_beside_context_run_but_the_search_does_not_offer_them():
    parallel = {"context": {"degree": 2, "mode": "ring"}, "pipeline": {"stages": 2}, "tensor": {"degree": 2}}
    model = {"model_type": "llama", "num_heads": 4, "num_kv_heads": 2}
    training = {"seq_len": 16}
    assert context_problems(parallel, model, training, with_tensor=True, with_pipeline=True) == []
    # The search's cost model does not price C x P: its pins stay refused there.
    assert any("with pipeline stages" in problem for problem in context_problems(parallel, model, training))


def test_mesh_groups_put_the_context_index_between_the_stage_and_the_tensor_index():
    # rank = ((data x P + stage) x C + context) x T + tensor, world 8 = data 2 x P 2 x C 2.
    groups = mesh_groups(8, pipeline=2, tensor=1, context=2)
    assert groups["pipeline"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # The chunk engine's group: data x context at one stage.
    assert groups["data"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
