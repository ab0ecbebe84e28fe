"""The parallel layouts the joint search tries: tensor degree and mode, pipeline degree.

Rules (docs/costmodel-and-search.md, decision map):

* tensor degree T: divisors of the GPUs of one node (tensor traffic is per layer and latency-bound,
  so it stays on the node's links) that divide the attention heads and the key/value heads, and
  whose local shapes exist for every parameter (a vocabulary of 50257 does not split by 2);
  mode 1d for each, and 2d where T is a square q x q >= 4 and every style of the table has a grid
  form (``grid_problem``: the same table the engine's 2D plan is built from); only for models with a tensor table
  (``plan/tensor_layout.py``: from the model's transformers tensor plan, recorded in the profile);
* pipeline degree P: divisors of world / T up to the number of blocks, modular assignment (or the
  pinned one, ``--fix assignment=contiguous``: one run of blocks per stage, GPipe's bubble) and the
  looped breadth-first schedule; beside it 1F1B (``schedule_choices``) where that split runs it
  (one virtual stage per rank: contiguous, or modular with P equal to the blocks): GPipe's bubble,
  but stage s holds at most P - s micro-batches' activations, so it wins where memory decides. The
  joint search gives it only steps of at least P micro-batches (``plan/stages.py``
  ``schedule_problem``); ``--fix schedule`` pins either;
* the data degree world / (P x T) must divide the global batch;
* pipeline and tensor parallelism together (world = data x P x T, each stage tensor-parallel in its
  tensor group), 1d or 2d (a stage sends each rank's piece of the residual stream to its peer);
* expert degree E (``parallel.expert.degree``) for a mixture-of-experts model whose config ships an
  expert plan (``arch.num_experts`` > 0, with expert tensors the cost model recognises): every E >= 2
  that divides the data degree and the experts per block, on the layouts the engine runs it with
  (``capabilities.expert_parallel_conflicts``: data parallelism only in this version); the joint
  search then skips the shapes it does not run with (layered accumulation);
* context degree C with each mode (``search/context_layouts.py``): beside every layout above, where
  ``plan/context.py`` accepts it (the same rules as ``validate``; this version: data x context only)
  and the data degree world / (P x T x C) divides the global batch;
* only the layouts the engine can run for this model (``ModelProfile.layout_reasons``, from
  ``plan/capabilities.py``): a model without a stage plan gets no pipeline, one without a
  tensor table no tensor parallelism, and a pin of either is refused with the reason.

``--fix pipeline=P``, ``--fix tensor=T``, ``--fix tensor_mode=1d|2d``, ``--fix expert=E``,
``--fix context=C`` and ``--fix context_mode=M`` pin them (checked here).
Whether the training script's loop allows these layouts at all is the driver's question
(``search(loop=...)``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import cast

from elixir_tune.costmodel.expert import expert_param_indices
from elixir_tune.costmodel.parallel import Layout, cast_mode, pipeline_degrees, tensor_degrees
from elixir_tune.plan.capabilities import expert_parallel_conflicts, expert_parallel_limits, frozen_layout_problem
from elixir_tune.plan.schema import PipelineAssignment, PipelineSchedule, TensorMode
from elixir_tune.plan.stages import schedule_problem
from elixir_tune.plan.tensor_layout import grid_problem, local_shape, table_for
from elixir_tune.profiler.schema import ModelProfile
from elixir_tune.search.context_layouts import context_pin_problem, context_variants


def _splits(profile: ModelProfile, degree: int, mode: str) -> bool:
    """Whether every parameter has a local shape at this tensor degree and mode."""
    try:
        for param in profile.params:
            local_shape(
                param.name, list(param.shape), profile.arch.model_type, degree, mode, profile.arch.tensor_layout
            )
    except ValueError:
        return False
    return True


def tensor_choices(profile: ModelProfile, gpus_per_node: int, fixed: dict) -> list[tuple[int, TensorMode]]:
    """(T, mode) pairs to try, or the pinned ones, checked.

    Raises:
        ValueError: a pinned degree or mode the model or the node does not allow (says why).
    """
    pinned_t, pinned_mode = fixed.get("tensor"), fixed.get("tensor_mode")
    cannot = profile.layout_reasons().get("tensor")
    if cannot:  # the engine cannot split this model: data (and pipeline) parallelism only
        if (pinned_t or 1) > 1 or pinned_mode == "2d":
            shown = f"--fix tensor={pinned_t}" if pinned_t else "--fix tensor_mode=2d"
            raise ValueError(f"{shown}: not possible for {profile.name}: {cannot}; drop the pin")
        return [(1, "1d")]
    allowed = [(t, m) for t, m in tensor_degrees(profile, gpus_per_node) if t == 1 or _splits(profile, t, m)]
    no_grid = grid_problem(table_for(profile.arch.model_type, profile.arch.tensor_layout))
    if pinned_mode == "2d" and no_grid:
        raise ValueError(f"--fix tensor_mode=2d: not possible for {profile.name}: {no_grid}")
    if pinned_mode == "2d" and pinned_t is None:
        chosen: list[tuple[int, TensorMode]] = [(t, m) for t, m in allowed if m == "2d"]
        if not chosen:
            raise ValueError(
                f"--fix tensor_mode=2d: no square tensor degree >= 4 fits {profile.name} on {gpus_per_node} GPUs per "
                "node (it must divide the node's GPUs and the heads, and the model family needs a tensor layout)"
            )
        return chosen
    if pinned_t is None:
        return allowed
    mode = cast_mode(pinned_mode or "1d")
    if (pinned_t, mode) in allowed:
        return [(pinned_t, mode)]
    arch = profile.arch
    if pinned_t > 1 and not arch.num_heads:
        why = (
            f"the profile records no attention heads for model type {arch.model_type!r} (the tensor degree must "
            "divide them; a family without attention needs a tensor plan that splits what it has instead)"
        )
    elif gpus_per_node % pinned_t:
        why = f"it does not divide the {gpus_per_node} GPUs of a node (tensor parallelism stays within a node)"
    elif arch.num_heads % pinned_t or (arch.num_kv_heads or arch.num_heads) % pinned_t:
        why = f"it does not divide the {arch.num_heads} heads and {arch.num_kv_heads or arch.num_heads} key/value heads"
    elif mode == "2d" and (pinned_t < 4 or math.isqrt(pinned_t) ** 2 != pinned_t):
        why = "mode 2d needs a square degree q x q of at least 4"
    elif mode == "1d" and profile.seq_len % pinned_t:
        why = f"sequence parallelism splits the {profile.seq_len} tokens of a sample by T, and {pinned_t} does not divide them"
    elif not any(t > 1 for t, _ in tensor_degrees(profile, gpus_per_node)):
        why = f"model type {arch.model_type!r} has no tensor table (tensor parallelism needs a tensor plan for its family)"
    else:
        why = "a parameter does not split evenly (e.g. the vocabulary size)"
    raise ValueError(f"--fix tensor={pinned_t} (mode {mode}): not possible for {profile.name}: {why}")


def layout_choices(
    profile: ModelProfile, gpus_per_node: int, nodes: int, global_batch_size: int, fixed: dict
) -> list[Layout]:
    """Layouts to search, data parallelism only first.

    Args:
        profile: the whole model's profile.
        gpus_per_node: ranks per node.
        nodes: nodes.
        global_batch_size: samples per step.
        fixed: pinned choices (``parse_fixed``).

    Returns:
        The layouts.

    Raises:
        ValueError: a pinned pipeline or tensor degree that cannot be used (says why).
    """
    world = gpus_per_node * nodes
    num_blocks = len(profile.blocks)
    cannot_pipeline = profile.layout_reasons().get("pipeline")
    if cannot_pipeline and fixed.get("pipeline", 1) > 1:
        raise ValueError(
            f"--fix pipeline={fixed['pipeline']}: not possible for {profile.name}: {cannot_pipeline}; drop the pin"
        )
    layouts = []
    bases = []  # every layout whatever its batch split: a context degree may make the split work
    for degree, mode in tensor_choices(profile, gpus_per_node, fixed):
        if world % degree:
            continue
        stage_choices = [1] if cannot_pipeline else pipeline_degrees(world, degree, num_blocks)
        if "pipeline" in fixed:
            stage_choices = [fixed["pipeline"]] if fixed["pipeline"] in stage_choices else []
        for stages in stage_choices:
            if profile.lora and frozen_layout_problem(stages, degree, mode):
                continue  # a LoRA base in frozen chunks: not every layout runs it yet (plan/capabilities.py)
            for assignment, schedule in schedule_choices(num_blocks, stages, fixed):
                base = Layout(stages, degree, cast_mode(mode), assignment, schedule=cast(PipelineSchedule, schedule))
                bases.append(base)
                if not global_batch_size % (world // (stages * degree)):
                    layouts.append(base)
    stages = fixed.get("pipeline", 1)
    if stages > 1 and fixed.get("accumulation") == "standard":
        raise ValueError(
            f"--fix pipeline={stages} with --fix accumulation=standard: a pipeline runs its micro-batches "
            "breadth-first, layer by layer (layered); drop one of the pins"
        )
    if stages > 1 and stages > num_blocks:
        raise ValueError(
            f"--fix pipeline={stages}: the model has {num_blocks} repeated blocks; a stage needs at least one"
        )
    pinned_schedule = fixed.get("schedule")
    if stages > 1 and pinned_schedule:
        assignment = fixed.get("assignment", "modular")
        why = schedule_problem(num_blocks, stages, assignment, pinned_schedule)
        if why:
            raise ValueError(f"--fix schedule={pinned_schedule}: {why}")
        # The most micro-batches a step can have: the smallest micro-batch on the fewest data ranks.
        per_rank = max((global_batch_size // layout.data_degree(world) for layout in layouts), default=0)
        most = per_rank // fixed.get("micro_batch_size", 1)
        if layouts and schedule_problem(num_blocks, stages, assignment, pinned_schedule, most):
            raise ValueError(
                f"--fix schedule={pinned_schedule}: it needs at least {stages} micro-batches per step, and a global "
                f"batch of {global_batch_size} leaves at most {most} per data rank; raise the global batch, lower "
                "--fix micro_batch_size, or pin schedule=looped_bfs"
            )
    frozen_problem = frozen_layout_problem(
        fixed.get("pipeline", 1), fixed.get("tensor", 1), fixed.get("tensor_mode", "1d")
    )
    if profile.lora and frozen_problem:
        raise ValueError(
            f"the pins --fix pipeline/tensor/tensor_mode: not possible for {profile.name}: {frozen_problem}"
        )
    layouts = _with_context_degrees(profile, layouts, bases, gpus_per_node, nodes, global_batch_size, fixed)
    pins = [f"{axis}={fixed[axis]}" for axis in ("pipeline", "tensor", "context", "expert") if axis in fixed]
    if not layouts and pins:
        raise ValueError(
            f"the layout pins {', '.join(pins)} leave no layout of the world of {world} GPUs whose data-parallel "
            f"degree divides the global batch {global_batch_size}; raise --global-batch-size to a multiple of the "
            "data-parallel degree, or drop a pin (the plain loop runs pipeline 1 and tensor 1 only: "
            "--loop forward_backward lifts that)"
        )
    if not layouts:
        raise ValueError(
            f"no parallel layout divides the global batch {global_batch_size} into data-parallel shares "
            "(raise the global batch to a multiple of the data-parallel degree)"
        )
    return layouts


def _with_context_degrees(
    profile: ModelProfile,
    layouts: list[Layout],
    bases: list[Layout],
    gpus_per_node: int,
    nodes: int,
    global_batch_size: int,
    fixed: dict,
) -> list[Layout]:
    """``layouts`` with their expert degrees, and the context-parallel layouts beside them
    (``search/context_layouts.py``); with ``--fix context=C`` > 1 only those with C.

    Raises:
        ValueError: a pinned expert degree no layout allows, or a pinned context degree none does (says why).
    """
    pinned = fixed.get("context", 1)
    world = gpus_per_node * nodes
    with_experts = _with_expert_degrees(profile, layouts, world, fixed) if layouts or pinned == 1 else []
    expert_bases = [layout for layout in with_experts if layout.expert > 1]
    # A pinned expert degree keeps its layouts only: context variants of them alone.
    candidates = expert_bases if fixed.get("expert", 1) > 1 else bases + expert_bases
    variants = context_variants(profile, candidates, gpus_per_node, nodes, global_batch_size, fixed)
    if pinned > 1:
        if not variants:
            raise ValueError(
                context_pin_problem(profile, bases[0] if bases else Layout(), world, global_batch_size, fixed)
            )
        return variants
    return with_experts + variants


def schedule_choices(num_blocks: int, stages: int, fixed: dict) -> list[tuple[PipelineAssignment, str]]:
    """(assignment, schedule) pairs a pipeline of ``stages`` is searched with, looped breadth-first first.

    The split is the pinned assignment, else modular (the smaller bubble). The looped breadth-first
    schedule runs any split; 1F1B one virtual stage per rank (``schedule_problem``: contiguous, or
    modular with P equal to the blocks). 1F1B on another split than the breadth-first one would
    also change the assignment (a contiguous split: a larger bubble, fewer sends), which the search
    leaves to ``--fix assignment=contiguous``. ``--fix schedule`` keeps one of the two.

    Args:
        num_blocks: blocks in the model's block list.
        stages: P (1: no pipeline, one pair).
        fixed: pinned choices (``parse_fixed``).

    Returns:
        The pairs (empty when the pinned schedule cannot run the pinned split).
    """
    if stages <= 1:
        return [("modular", "looped_bfs")]
    assignment: PipelineAssignment = fixed.get("assignment", "modular")
    pinned = fixed.get("schedule")
    schedules = [pinned] if pinned else ["looped_bfs", "1f1b"]
    return [(assignment, s) for s in schedules if schedule_problem(num_blocks, stages, assignment, s) is None]


def expert_degrees(profile: ModelProfile, data_size: int) -> list[int]:
    """Expert degrees E >= 2 the model allows at a data degree: E divides the data degree and the
    experts per block; none for a model without an expert plan (``arch.num_experts`` 0) or whose
    expert tensors the cost model does not find (``expert.expert_param_indices``)."""
    experts = profile.arch.num_experts
    if experts <= 1 or not expert_param_indices(profile):
        return []
    return [e for e in range(2, min(data_size, experts) + 1) if data_size % e == 0 and experts % e == 0]


def _with_expert_degrees(profile: ModelProfile, layouts: list[Layout], world: int, fixed: dict) -> list[Layout]:
    """``layouts`` and, beside each the engine runs expert parallelism with, one per expert degree;
    with ``--fix expert=E`` only those with E (checked: says why none can take it).

    Raises:
        ValueError: a pinned expert degree no layout allows.
    """
    pinned = fixed.get("expert")
    accumulation = fixed.get("accumulation", "standard")  # layered pinned: no shape of an expert layout runs
    out = [] if pinned and pinned > 1 else list(layouts)
    for layout in layouts:
        if expert_parallel_conflicts(layout.pipeline, layout.tensor, accumulation):
            continue
        data = layout.data_degree(world)
        degrees = expert_degrees(profile, data)
        out += [replace(layout, expert=e) for e in degrees if pinned in (None, e)]
    if pinned and pinned > 1 and not out:
        experts = profile.arch.num_experts
        if not experts:
            why = "the model ships no expert plan (its config has no base_model_ep_plan dispatching tokens to experts)"
        elif experts % pinned:
            why = f"it does not divide the model's {experts} experts per block"
        elif all(expert_parallel_conflicts(lay.pipeline, lay.tensor, accumulation) for lay in layouts):
            why = f"the engine does not run expert parallelism beside {expert_parallel_limits()}"
        else:
            why = "it does not divide the data-parallel size of any layout"
        raise ValueError(f"--fix expert={pinned}: not possible for {profile.name}: {why}; drop the pin")
    return out
