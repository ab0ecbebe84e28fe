"""One rank's view of a profile under a pipeline, tensor or expert layout.

``rank_profile`` turns the whole model's profile into what one rank of a pipeline stage holds and
runs (its stage's parameters at their tensor-parallel local shapes, its share of FLOPs and
activations), so that the chunk layout, trace, cache simulation, memory model and timeline of the
data-parallel cost model work on it unchanged. ``held_grad_numel`` adds what a pipeline step holds
beside the profile (no-sync gradients), ``tied_params`` the parameters the first and last stage
share, and ``critical_stage`` the stage the search sizes memory and time by. The formulas these
use (activation factors of tensor parallelism) are in ``costmodel/parallel.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from elixir_tune.costmodel.expert import expert_param_indices
from elixir_tune.costmodel.parallel import Layout, tp_activation_factor, tp_boundary_factor
from elixir_tune.plan.stages import assign_stages, last_stage, stage_of_block
from elixir_tune.plan.stages import virtual_stages as stage_runs
from elixir_tune.plan.tensor_layout import local_shape
from elixir_tune.profiler.schema import ActivationLine, BlockInfo, ModelProfile


def _stage_params(profile: ModelProfile, layout: Layout, stage: int) -> list[int]:
    """Indices of the parameters one pipeline stage holds, in first-use order.

    ``assign_stages`` places every parameter once; a tied parameter outside the blocks (GPT-2's
    ``wte``, also the output head) is held by the last stage as well, which all-reduces its gradient
    with the first stage once per step.
    """
    params = profile.params
    if layout.pipeline <= 1:
        return list(range(len(params)))
    names = [p.name for p in params]
    stage_of = assign_stages(names, profile.block_list, len(profile.blocks), layout.pipeline, layout.assignment)
    in_block = {i for b in profile.blocks for i in range(b.first_param, b.first_param + b.num_params)}
    last = last_stage(len(profile.blocks), layout.pipeline, layout.assignment)
    return [
        i
        for i, p in enumerate(params)
        if stage_of[p.name] == stage or (stage == last and p.shared and i not in in_block)
    ]


def tied_params(profile: ModelProfile, layout: Layout) -> list[int]:
    """Tied parameters the first and last stage both hold (empty with one stage)."""
    if layout.pipeline <= 1:
        return []
    first = set(_stage_params(profile, layout, 0))
    last = last_stage(len(profile.blocks), layout.pipeline, layout.assignment)
    if last == 0:  # both users on stage 0 (an uneven modular split): nothing to sum between stages
        return []
    return [i for i in _stage_params(profile, layout, last) if i in first]


@dataclass
class StageProfile(ModelProfile):
    """One rank's profile under a pipeline or tensor layout (``rank_profile``), with what a pipeline
    step holds beside what the profile describes.

    Attributes:
        held_grad_numel: gradient elements the rank holds unsharded at the step's peak when a step
            runs several micro-batches (``held_grad_numel``); 0 without a pipeline.
        whole_grad_numel: elements of the largest gradient that arrives whole although its parameter
            is split (the input embedding under 1d tensor parallelism, on the stage that runs it:
            torch's vocabulary-parallel embedding computes the whole table's gradient on every
            tensor rank); 0 when none does.
        recv_buffer_bytes_per_sample: the receive buffers torch's ``PipelineStage`` allocates for
            each micro-batch of a step, one sample's worth (``recv_buffer_bytes``); 0 without a pipeline.
    """

    held_grad_numel: int = 0
    whole_grad_numel: int = 0
    recv_buffer_bytes_per_sample: int = 0


def recv_buffer_bytes(profile: ModelProfile, layout: Layout, stage: int) -> int:
    """Bytes of one sample in the receive buffers of one rank of pipeline stage ``stage``.

    torch's ``PipelineStage`` allocates, for every micro-batch of the step and for every virtual
    stage of the rank, a buffer for the activations it receives (each virtual stage but the
    pipeline's first) and one for the gradient of its output (each but the last), and keeps them
    from step to step. The received activations are the virtual stage's inputs, which no block's
    figure holds (a block's retained bytes start at its input), so under every schedule the rank
    holds one of each per micro-batch, even where 1F1B holds fewer micro-batches' activations.

    Args:
        profile: the whole model's profile (the blocks' input bytes).
        layout: the parallel layout (hidden states / T with sequence parallelism).
        stage: the pipeline stage.

    Returns:
        Bytes per sample (0 with one stage).
    """
    if layout.pipeline <= 1 or not profile.blocks:
        return 0
    runs = stage_runs(len(profile.blocks), layout.pipeline, layout.assignment)
    boundary = [b.boundary_bytes_per_sample for b in profile.blocks]
    total = 0
    for index, (run_stage, blocks) in enumerate(runs):
        if run_stage != stage:
            continue
        if index > 0:  # activations in
            total += boundary[blocks[0]]
        if index < len(runs) - 1:  # the output's gradient in: the next block's input
            total += boundary[blocks[-1] + 1]
    return int(total * tp_boundary_factor(layout.tensor_mode, layout.tensor, layout.sequence_parallel))


def held_grad_numel(profile: ModelProfile, layout: Layout, stage: int, local_numel: dict[int, int]) -> int:
    """Gradient elements one rank of pipeline stage ``stage`` holds unsharded at a step's peak.

    The engine's pipeline step is no-sync (``engine/parallel/pipeline.py``): each parameter's gradient stays
    in ``param.grad``, in compute dtype and whole (not sharded), from its first micro-batch's
    backward until its last one's, when it is staged and reduce-scattered. Under ``looped_bfs`` (the
    search's default schedule; torch's ``ScheduleLoopedBFS``) a rank runs the backwards of its virtual stages
    one after the other, all micro-batches of each, so the gradients of one virtual stage are held at
    a time: the peak is the largest virtual stage's trainable elements. ``gpipe`` and ``1f1b`` run one
    virtual stage per rank: the same formula. (``interleaved_1f1b`` with N >= 2P micro-batches holds
    every virtual stage's at once; the search never picks it, the engine reports it.)

    Block parameters go with their block's virtual stage, the others with the first virtual stage
    (used before the blocks: embeddings) or the last (final norm, head); a tied one before the blocks
    (GPT-2's ``wte``, also the head) with both, where this stage runs them. Under 1d tensor
    parallelism an embedding's gradient on the first virtual stage is the whole table's, not this
    rank's rows: torch's vocabulary-parallel embedding computes it whole on every tensor rank (the
    engine slices it when it stages it; measured in tests/distributed/test_plan_memory_layouts.py).

    Args:
        profile: the whole model's profile.
        layout: the parallel layout.
        stage: the pipeline stage, 0..P-1.
        local_numel: profile parameter index -> its elements on this rank (tensor-parallel local
            shape), for the parameters the stage holds.

    Returns:
        Elements (0 with one stage).
    """
    if layout.pipeline <= 1 or not profile.blocks:
        return 0
    runs = stage_runs(len(profile.blocks), layout.pipeline, layout.assignment)
    run_of_block = {block: run for run, (_, blocks) in enumerate(runs) for block in blocks}
    block_of = {i: b.index for b in profile.blocks for i in range(b.first_param, b.first_param + b.num_params)}
    first_block_param = min(block_of, default=len(profile.params))
    first_run, last_run = 0, len(runs) - 1
    held = {run: 0 for run, (run_stage, _) in enumerate(runs) if run_stage == stage}
    for index, numel in local_numel.items():
        param = profile.params[index]
        if not param.requires_grad:
            continue
        if index in block_of:
            targets = {run_of_block[block_of[index]]}
        elif index < first_block_param:
            targets = {first_run, last_run} if param.shared else {first_run}
        else:
            targets = {last_run}
        whole_on_first = layout.tensor > 1 and layout.tensor_mode == "1d" and index < first_block_param
        for run in targets & held.keys():
            held[run] += param.numel if whole_on_first and run == first_run else numel
    return max(held.values(), default=0)


def _scaled_line(line: ActivationLine, per_sample: float) -> ActivationLine:
    return ActivationLine(fixed_bytes=line.fixed_bytes, per_sample_bytes=max(0, int(per_sample)))


def rank_profile(profile: ModelProfile, layout: Layout, stage: int) -> ModelProfile:
    """What one rank of pipeline stage ``stage`` holds and runs under ``layout``, as a profile.

    Parameters: the stage's, each at its tensor-parallel local shape (an expert tensor at 1/E of its
    experts under expert degree E: ``costmodel/expert.py``). Trace: the whole model's,
    restricted to them (blocks keep their global index, as the plan's checkpointing rule reads it).
    FLOPs: the stage's blocks (and the output head and loss on the last stage), divided by T.
    Activations: the stage's share of the blocks' (by their profiled per-block bytes) times the
    tensor-parallel factor, plus on the last stage what the profile has beyond the blocks (logits
    and loss, whole: the engine gathers the logits before the loss).

    Args:
        profile: the whole model's profile.
        layout: the parallel layout.
        stage: the pipeline stage, 0..P-1.

    Returns:
        The rank's profile, a ``StageProfile`` (``profile`` itself when the layout has no P, T or E).
    """
    if layout.pipeline <= 1 and layout.tensor <= 1 and layout.expert <= 1:
        return profile
    experts = expert_param_indices(profile) if layout.expert > 1 else frozenset()
    keep = _stage_params(profile, layout, stage)
    new_index = {old: new for new, old in enumerate(keep)}
    arch = profile.arch
    degree, mode = layout.tensor, layout.tensor_mode
    params = []
    for old in keep:
        param = profile.params[old]
        if degree > 1:
            shape = local_shape(param.name, list(param.shape), arch.model_type, degree, mode, arch.tensor_layout)
            param = replace(param, shape=shape, numel=math.prod(shape))
        if old in experts:  # this rank's experts: [experts / E, ...]
            shape = [param.shape[0] // layout.expert, *param.shape[1:]]
            param = replace(param, shape=shape, numel=math.prod(shape))
        params.append(param)

    def restrict(trace: list[list[int]]) -> list[list[int]]:
        steps = [[new_index[i] for i in step if i in new_index] for step in trace]
        return [step for step in steps if step]

    is_last = stage == last_stage(len(profile.blocks), layout.pipeline, layout.assignment)
    num_blocks = len(profile.blocks)
    mine = [
        b for b in profile.blocks if stage_of_block(b.index, num_blocks, layout.pipeline, layout.assignment) == stage
    ]
    act_factor = tp_activation_factor(mode, degree, layout.sequence_parallel)
    boundary_factor = tp_boundary_factor(mode, degree, layout.sequence_parallel)
    blocks = [
        BlockInfo(
            index=b.index,
            first_param=new_index[b.first_param] if b.num_params else 0,
            num_params=b.num_params,
            fwd_flops_per_sample=b.fwd_flops_per_sample / degree,
            activation_bytes_per_sample=int(b.activation_bytes_per_sample * act_factor),
            boundary_bytes_per_sample=int(b.boundary_bytes_per_sample * boundary_factor),
            dropout_scores_per_sample=b.dropout_scores_per_sample // degree,  # the rank's heads (or grid share)
        )
        for b in mine
        if b.num_params == 0 or b.first_param in new_index
    ]
    all_fwd = sum(b.fwd_flops_per_sample for b in profile.blocks)
    mine_fwd = sum(b.fwd_flops_per_sample for b in mine)
    head_flops = max(0.0, profile.flops_per_sample - 3 * all_fwd)  # embeddings, head and loss
    flops = (3 * mine_fwd + (head_flops if is_last else 0.0)) / degree
    fwd_share = mine_fwd / all_fwd if all_fwd else (1.0 if is_last else 0.0)

    runs_block0 = bool(profile.blocks) and stage == stage_of_block(0, num_blocks, layout.pipeline, layout.assignment)

    def stage_line(
        line: ActivationLine,
        per_block: list[int],
        mine_per_block: list[int],
        factor: float,
        tail: float,
        prologue: float = 0.0,
    ):
        total = sum(per_block)
        blocks_part = min(line.per_sample_bytes, total)
        share = sum(mine_per_block) / total if total else 0.0
        if is_last:
            # What lies beyond the blocks (logits and loss) stays whole under TP: the engine gathers the
            # logits before the model's own loss (the vocabulary-parallel loss is opt-in and no plan
            # field selects it); measured (docs/parallel.md, TP activations). Of what lies
            # before them (the prologue) the first stage holds block 0's input instead; the rest (a
            # causal mask, position tensors) every stage's forward builds again, so it stays here too.
            moved = min(prologue, profile.blocks[0].boundary_bytes_per_sample) if prologue and not runs_block0 else 0.0
            tail = line.per_sample_bytes - blocks_part - moved
        elif runs_block0:
            tail += prologue * boundary_factor
        return _scaled_line(line, blocks_part * share * factor + max(0.0, tail))

    activation = stage_line(
        profile.activation,
        [b.activation_bytes_per_sample for b in profile.blocks],
        [b.activation_bytes_per_sample for b in mine],
        act_factor,
        0.0,
        # Checkpointed, block 0's input is its boundary, counted with the blocks: the prologue only here.
        profile.prologue_bytes_per_sample,
    )
    checkpointed = None
    if profile.activation_checkpointed is not None:
        # Beside its blocks' inputs, a non-last stage's backward holds one recomputed block at a time.
        one_block = max((b.activation_bytes_per_sample for b in mine), default=0) * act_factor
        checkpointed = stage_line(
            profile.activation_checkpointed,
            [b.boundary_bytes_per_sample for b in profile.blocks],
            [b.boundary_bytes_per_sample for b in mine],
            boundary_factor,
            one_block,
        )
    held = held_grad_numel(profile, layout, stage, {old: p.numel for old, p in zip(keep, params, strict=True)})
    whole = 0
    if degree > 1 and mode == "1d" and runs_block0:
        first_block_param = min((b.first_param for b in profile.blocks if b.num_params), default=len(profile.params))
        before = [profile.params[old] for old in keep if old < first_block_param]  # the embeddings
        whole = max((p.numel for p in before if p.requires_grad), default=0)
    stage_profile = replace(
        profile,
        num_params=max(1, sum(p.numel for p in params)),
        params=params,
        trace=restrict(profile.trace),
        trace_checkpointed=restrict(profile.trace_checkpointed),
        blocks=blocks,
        flops_per_sample=flops,
        recompute_flops_per_sample=profile.recompute_flops_per_sample * fwd_share / degree,
        # The profile counts pointwise bytes for the whole model only: a rank's share is its FLOPs'.
        pointwise_bytes_per_sample=profile.pointwise_bytes_per_sample * flops / max(profile.flops_per_sample, 1.0),
        recompute_pointwise_bytes_per_sample=profile.recompute_pointwise_bytes_per_sample * fwd_share / degree,
        activation=activation,
        activation_checkpointed=checkpointed,
        selective=None,  # traced for the whole model; selective runs with data parallelism only (capabilities)
    )
    return StageProfile(
        **{f.name: getattr(stage_profile, f.name) for f in fields(ModelProfile)},
        held_grad_numel=held,
        whole_grad_numel=whole,
        recv_buffer_bytes_per_sample=recv_buffer_bytes(profile, layout, stage),
    )


def critical_stage(profile: ModelProfile, layout: Layout) -> int:
    """The stage whose rank holds the most parameter elements (ties: the later, which also runs the
    head and loss): the one the search sizes memory and time by."""
    if layout.pipeline <= 1:
        return 0
    sizes = [
        (sum(p.numel for p in rank_profile(profile, layout, stage).params), stage) for stage in range(layout.pipeline)
    ]
    return max(sizes)[1]
