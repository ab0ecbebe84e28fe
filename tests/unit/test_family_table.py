"""The families x layouts table of docs/parallel.md is what the engine accepts: each family's tiny
causal LM (tests/unit/models/stage_families.py, on the meta device) is asked whether it gets a tensor
table (``tensor_table.model_tensor_table``), whether that table has a 2D grid form
(``tensor_layout.grid_problem``, what the engine's ``tp_grid.grid_plan`` and the search check), a stage plan
(``stage_plans.pipeline_problem``) and whether its config ships an expert plan; the table rendered
from the answers must be the one in docs/parallel.md, between its markers.

To rewrite the page's table after a change: ``PYTHONPATH=. python tests/unit/test_family_table.py``.
"""

from __future__ import annotations

from pathlib import Path

from elixir_tune.plan.capabilities import PIPELINE_MODEL_TYPES
from elixir_tune.plan.tensor_layout import grid_problem
from tests.distributed.test_engine_tensor_families import FAMILIES as TENSOR_FAMILIES
from tests.distributed.test_engine_tensor_grid import FAMILIES as GRID_FAMILIES

PAGE = Path(__file__).resolve().parents[2] / "docs" / "parallel.md"
BEGIN, END = "<!-- families x layouts: begin (tests/unit/test_family_table.py) -->", "<!-- families x layouts: end -->"
# Verified against plain PyTorch at world 2 (tests/distributed/test_engine_tensor_families.py and
# test_engine_tensor_parallel.py; every pipeline family in test_engine_pipeline_families.py).
TENSOR_TESTED = {*TENSOR_FAMILIES, "llama", "gpt2"}  # llama and gpt2: test_engine_tensor_parallel.py
# 2D at tensor 2 x 2, world 4: gpt2 and llama in test_engine_tensor_parallel.py, the others in
# tests/distributed/test_engine_tensor_grid.py.
GRID_TESTED = {"gpt2", "llama", *GRID_FAMILIES}
EXPERT_TESTED = {"qwen3_moe", "mixtral"}  # tests/distributed/test_engine_expert_parallel.py


def _why(text: str) -> str:
    """A refusal's reason, short enough for a table cell."""
    if "ships no tensor plan" in text or "no pipeline plan" in text:
        return "no: the family ships no plan"
    if "beside the experts" in text:
        return "no: shared experts split beside the experts"
    if "no grid form" in text:
        return "no: the experts have no grid form"
    if "does not place" in text:
        return "no: the plan leaves linears unplaced (latent attention)"
    return "no: " + text[:60]


def family_rows() -> list[list[str]]:
    from elixir_tune.models.stage_plans import pipeline_problem, resolve_stage_plan
    from elixir_tune.models.tensor_table import model_tensor_table
    from elixir_tune.profiler.arch import model_arch
    from elixir_tune.profiler.source import quiet_transformers
    from tests.unit.models import stage_families

    rows = []
    for family in sorted(stage_families.FAMILIES):
        with quiet_transformers():
            model = stage_families.build(family, meta=True)
        config_class = type(model.config)
        table, why = model_tensor_table(model)
        tp_source = "its `tp_plan`" if getattr(config_class, "base_model_tp_plan", None) else ""
        if table and not tp_source:
            tp_source = "ours (`plan/tensor_layout.py`)"
        tensor = ("yes" + (" (tested)" if family in TENSOR_TESTED else "")) if table else _why(why)
        no_grid = grid_problem(table) if table else ""
        grid = ("yes" + (" (tested)" if family in GRID_TESTED else "")) if table and not no_grid else "-"
        grid = _why(no_grid) if no_grid else grid
        problem = pipeline_problem(model)
        stage_plan = resolve_stage_plan(model)
        pipeline = (
            ("yes" + (" (tested)" if family in PIPELINE_MODEL_TYPES else "")) if problem is None else _why(problem)
        )
        pp_source = getattr(stage_plan, "source", "")
        pp_source = {"transformers base_model_pp_plan": "its `pp_plan`"}.get(
            pp_source, "ours (`stage_plans.py`)" if pp_source else ""
        )
        if model_arch(model).num_experts:  # the profile records experts: expert parallelism accepts it
            expert = "yes (tested)" if family in EXPERT_TESTED else "yes"
        else:
            expert = "plan shipped, not run" if getattr(config_class, "base_model_ep_plan", None) else "-"
        rows.append([family, tensor, grid, pipeline, expert, tp_source or "-", pp_source or "-"])
    return rows


def render() -> str:
    header = ["family", "tensor 1D", "tensor 2D", "pipeline", "expert", "tensor plan from", "pipeline plan from"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in family_rows()]
    return "\n".join(lines)


def design_table() -> str:
    text = PAGE.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def test_design_table_is_what_the_engine_accepts():
    expected = render()
    assert design_table() == expected, (
        f"docs/parallel.md's families x layouts table is stale; it should be:\n{expected}"
    )


if __name__ == "__main__":
    text = PAGE.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    PAGE.write_text(text[:start] + "\n" + render() + "\n" + text[end:])
