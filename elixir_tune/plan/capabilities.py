"""What the engine can run for a model, and what a plan asks of the training script.

One place answers both questions (docs/plan.md, "The plan is a contract"), so that the profiler, the search,
``validate``, ``elixir-run``'s checks and the engine agree:

* **layouts**: pipeline stages need a stage plan for the model (``elixir_tune/models/stage_plans.py``:
  transformers' ``config.base_model_pp_plan``, or our table for GPT-2 and OPT), tensor parallelism a
  tensor table (``plan/tensor_layout.py``: translated from the model's ``config.base_model_tp_plan``
  when every style in it is one the engine runs, else the family's built-in table); both run
  transformers causal LMs only, and the profiler, which has the model, records the answer.
  ``unsupported_layouts`` gives, per layout the model cannot use, the reason; the
  profiler records it, the plan carries it, the search never offers those layouts and ``validate``
  refuses them.
* **the loop**: a data-parallel plan with standard accumulation runs under the plain loop a DDP or
  FSDP user writes (``model(**batch)`` then ``optimizer.backward(loss)`` per micro-batch, each rank
  reading its own share of the data). Pipeline stages, tensor parallelism and layered accumulation
  need ``loss = model.forward_backward(micro_batches)``, with every rank of one data index fed the
  same micro-batches (``elixir_tune.data_rank()``). ``training.loop`` in the plan says which loop
  the script runs; the search offers the second kind only when told the script runs
  ``forward_backward``.
* **expert parallelism**: what the engine runs beside ``parallel.expert.degree`` > 1
  (``EXPERT_PARALLEL_RUNS_WITH``, ``expert_parallel_conflicts``): ``validate`` refuses the rest, the
  search offers expert degrees only where none applies, and the cost model never offloads an expert
  chunk where the engine cannot.

Imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import get_args

from elixir_tune.plan.schema import LOOPS, LayoutName, Plan
from elixir_tune.plan.tensor_layout import supported_model_types

# Families whose causal LMs run on pipeline stages (stage_plans.py: transformers' base_model_pp_plan,
# or our table for gpt2 and opt), each tested against plain PyTorch. A profile records the answer for
# its own model (``pipeline_problem``); this list answers for records made before it did, and a unit
# test builds each family and checks stage_plans.py accepts it.
PIPELINE_MODEL_TYPES: tuple[str, ...] = (
    "deepseek_v3", "gemma2", "gpt2", "gpt_neox", "gptj", "granite", "llama", "mistral", "mixtral", "olmo2", "opt",
    "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
)  # fmt: skip
# ``unsupported_layouts(pipeline_problem=...)`` left out: the family list above decides.
FROM_FAMILY = "from the family"
LAYOUTS: tuple[str, ...] = get_args(LayoutName)
__all__ = ["EXPERT_PARALLEL_RUNS_WITH", "LAYOUTS", "LOOPS", "LOOP_CONTRACT", "PIPELINE_MODEL_TYPES"]

# What the engine runs beside expert parallelism (parallel.expert.degree > 1), tested against plain
# PyTorch: True where it runs. The one place validate, the search and the cost model read; lifting a
# limit in the engine is a change of its entry here (and of the sentence in EXPERT_LIMIT_REASONS).
EXPERT_PARALLEL_RUNS_WITH: dict[str, bool] = {
    # pipeline stages > 1 (validate refuses; the engine builds no expert groups inside a stage)
    "pipeline": False,
    # tensor degree > 1 (validate refuses; the experts would be split two ways)
    "tensor": False,
    # training.accumulation layered: each block runs all micro-batches at once, untested with the
    # token exchange
    "layered": False,
    # an expert chunk's shard on the host (tests/distributed/test_engine_expert_parallel.py, offload 0.5)
    "offloaded_experts": True,
    # setup(weights=...) or a model built on the meta device: each rank reads only its experts' rows
    "meta_start": True,
}
# The experts modules of the families whose config ships base_model_ep_plan (Qwen3-MoE, Mixtral,
# DeepSeek-V3: ``layers.*.mlp.experts``) end in this name; their parameters are the expert tensors.
EXPERTS_MODULE = "experts"
EXPERT_LIMIT_REASONS = {
    "pipeline": "pipeline stages",
    "tensor": "tensor parallelism",
    "layered": "layered accumulation",
    "offloaded_experts": "offloaded expert chunks",
    "meta_start": "a model built on the meta device or from weights=",
}


# Selective (per-op) checkpointing runs on the chunk engine's data-parallel path with standard
# accumulation, tested against plain PyTorch (tests/distributed/test_selective_checkpointing.py); the
# cost model's per-op figures are traced for the whole model (a pipeline stage, a tensor or context
# shard would need them per rank). Each entry: the plan field and how it reads when it conflicts.
SELECTIVE_RUNS_WITHOUT = {
    "pipeline": "pipeline stages",
    "tensor": "tensor parallelism",
    "context": "context parallelism",
    "expert": "expert parallelism",
    "layered": "layered accumulation",
}


def selective_conflicts(stages: int, tensor: int, context: int, expert: int, accumulation: str) -> list[str]:
    """What beside selective checkpointing the engine does not run (``SELECTIVE_RUNS_WITHOUT``)."""
    present = {
        "pipeline": stages > 1,
        "tensor": tensor > 1,
        "context": context > 1,
        "expert": expert > 1,
        "layered": accumulation == "layered",
    }
    return [SELECTIVE_RUNS_WITHOUT[key] for key, on in present.items() if on]


def frozen_layout_problem(stages: int, tensor_degree: int, tensor_mode: str = "1d") -> str:
    """Why a layout cannot hold frozen chunks (a LoRA base, docs/finetune-data.md); "" when it can.

    Frozen chunks run with data parallelism, with pipeline stages, with 1d tensor parallelism and with
    pipeline stages x 1d tensor parallelism, each tested against plain PEFT; 2d tensor parallelism is not
    tested with them yet.

    Args:
        stages: pipeline stages.
        tensor_degree: tensor degree.
        tensor_mode: ``1d`` or ``2d``.

    Returns:
        The reason, or "" when the engine runs frozen chunks under the layout.
    """
    if tensor_degree > 1 and tensor_mode != "1d":
        return f"frozen chunks (a LoRA base) run with 1d tensor parallelism, not {tensor_mode} yet"
    return ""


# What the script must do under each loop: the sentence the errors and `show` print.
LOOP_CONTRACT = {
    "plain": "model(**batch) and optimizer.backward(loss) for each micro-batch",
    "forward_backward": "loss = model.forward_backward(micro_batches), with the data slice of "
    "elixir_tune.data_rank() / elixir_tune.data_size()",
}


def unsupported_layouts(
    model_type: str,
    is_causal_lm: bool,
    tensor_problem: str | None = None,
    pipeline_problem: str | None = FROM_FAMILY,
) -> dict[str, str]:
    """The layouts the engine cannot run for a model, each with the reason.

    Args:
        model_type: the model's family (a transformers ``config.model_type``; "" for other models).
        is_causal_lm: the model is a transformers causal LM (it has an ``lm_head``).
        pipeline_problem: why the model itself cannot run pipeline stages (``stage_plans.pipeline_problem``,
            None: it can), as the profiler finds it on the model; left out, ``PIPELINE_MODEL_TYPES`` decides.

    Returns:
        ``{"pipeline": why, "tensor": why}`` for those it cannot run (empty when it runs both).
    """
    what = f"model type {model_type!r}" if model_type else "a model without a transformers config"
    reasons: dict[str, str] = {}
    if pipeline_problem != FROM_FAMILY:
        if pipeline_problem is not None:
            reasons["pipeline"] = pipeline_problem
    elif model_type not in PIPELINE_MODEL_TYPES:
        reasons["pipeline"] = (
            f"{what} has no pipeline plan known to run (stages run transformers causal LMs of the families "
            f"{', '.join(PIPELINE_MODEL_TYPES)}, and of other families whose base_model_pp_plan the profile "
            "accepted)"
        )
    elif not is_causal_lm:
        reasons["pipeline"] = f"pipeline stages run {model_type} causal LMs (with an lm_head) only"
    if tensor_problem:
        reasons["tensor"] = tensor_problem
    elif tensor_problem is None and model_type not in supported_model_types():
        reasons["tensor"] = (
            f"{what}: no tensor table is recorded for it (tensor parallelism needs a tensor plan for the "
            "model's family, read from its config.base_model_tp_plan when the model is profiled; built-in "
            f"tables: {', '.join(supported_model_types())})"
        )
    elif not is_causal_lm:
        reasons["tensor"] = f"tensor parallelism runs {model_type} causal LMs (with an lm_head) only"
    return reasons


def layout_reasons_of_type(model_type: str, tensor_layout: Mapping[str, str] | None = None) -> dict[str, str]:
    """``unsupported_layouts`` for a record that has only the family (an older profile or plan):
    a supported family is taken to be its causal LM, as the profiles of that time were; a recorded
    tensor table (``tensor_layout``) says tensor parallelism can run."""
    return unsupported_layouts(model_type, is_causal_lm=True, tensor_problem="" if tensor_layout else None)


def needs_forward_backward(stages: int, tensor_degree: int, accumulation: str) -> list[str]:
    """What in a layout needs the ``forward_backward`` loop (empty: the plain loop runs it).

    Args:
        stages: pipeline stages.
        tensor_degree: tensor degree.
        accumulation: ``standard`` or ``layered``.

    Returns:
        One phrase per reason, e.g. ``["pipeline stages 2"]``.
    """
    reasons = []
    if stages > 1:
        reasons.append(f"pipeline stages {stages} (the schedule runs the micro-batches through the stages)")
    if tensor_degree > 1:
        reasons.append(f"tensor degree {tensor_degree} (the ranks of a tensor group share each micro-batch)")
    if accumulation == "layered":
        reasons.append("layered accumulation (each block runs for all micro-batches of a step at once)")
    return reasons


def plan_loop(plan: Plan) -> str:
    """The loop the plan's training script runs: ``training.loop``, or for a plan written before it
    was recorded, the loop its layout needs."""
    if plan.training.loop is not None:
        return plan.training.loop
    needs = needs_forward_backward(
        plan.parallel.pipeline.stages, plan.parallel.tensor.degree, plan.training.accumulation
    )
    return "forward_backward" if needs else "plain"


def expert_parallel_conflicts(
    stages: int, tensor_degree: int, accumulation: str, offloaded_expert_chunks: int = 0
) -> list[str]:
    """What in a layout the engine does not run beside expert parallelism (``EXPERT_PARALLEL_RUNS_WITH``).

    Args:
        stages: pipeline stages.
        tensor_degree: tensor degree.
        accumulation: ``standard`` or ``layered``.
        offloaded_expert_chunks: chunks of expert tensors whose shard the plan puts on the host.

    Returns:
        One phrase per conflict, e.g. ``["pipeline stages 2"]`` (empty: the engine runs it).
    """
    asked = {
        "pipeline": (stages > 1, f"pipeline stages {stages}"),
        "tensor": (tensor_degree > 1, f"tensor degree {tensor_degree}"),
        "layered": (accumulation == "layered", "layered accumulation"),
        "offloaded_experts": (offloaded_expert_chunks > 0, f"{offloaded_expert_chunks} offloaded expert chunks"),
    }
    return [phrase for key, (used, phrase) in asked.items() if used and not EXPERT_PARALLEL_RUNS_WITH[key]]


def expert_parallel_limits() -> str:
    """The engine's current limits beside expert parallelism, as one phrase for errors and ``show``
    (e.g. ``"pipeline stages, tensor parallelism, ..."``; empty when there are none)."""
    return ", ".join(EXPERT_LIMIT_REASONS[key] for key, runs in EXPERT_PARALLEL_RUNS_WITH.items() if not runs)


def is_expert_param(name: str) -> bool:
    """Whether a parameter is an expert tensor (``[experts, ...]``) that expert parallelism splits: a
    parameter of a module named ``experts`` (the module the families' ``base_model_ep_plan`` names)."""
    return name.rpartition(".")[0].rpartition(".")[2] == EXPERTS_MODULE
