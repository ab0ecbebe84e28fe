"""Pipeline and tensor parallelism in the cost model: the formulas, and one rank's view of a profile.

The world is data x pipeline x tensor (``plan.schema.ParallelPlan``): ``D = world / (P * T)`` ranks
share each stage's chunks (the chunk engine shards over them), each rank runs the blocks of one
pipeline stage (``plan/stages.py``) with its tensor-parallel piece of every parameter
(``plan/tensor_layout.py`` ``local_shape``). ``rank_profile`` turns the whole model's profile into
what one such rank holds and runs, so that the chunk layout, trace, cache simulation, memory model
and timeline of the data-parallel cost model work on it unchanged; what parallelism adds on top
(tensor-parallel collectives, the pipeline bubble, point-to-point sends, the tied-embedding
all-reduce) is priced by the functions here.

Sources of the formulas:

* bubble of a looped breadth-first schedule: (P - 1) / (N v + P - 1) of the step, for N
  micro-batches and v virtual stages per rank (Lamy-Poirier, "Breadth-First Pipeline Parallelism",
  arXiv 2211.05953; the same as Narayanan et al. 2021's interleaved (P - 1) / (v N) of the ideal
  time). Modular assignment gives every rank v = blocks / P virtual stages of one block; a
  contiguous one v = 1 (GPipe's (P - 1) / (N + P - 1)).
* 1D tensor parallelism with sequence parallelism (Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models", arXiv 2205.05198): per layer, forward 2 all-gathers
  and 2 reduce-scatters of the b x s x h activations, backward the same; activations per rank
  s b h (34 / T) with sequence parallelism and s b h (10 + 24 / T) without (flash attention, no
  s x s scores kept, as the profiler measures).
* 2D tensor parallelism (Optimus, Xu et al., arXiv 2104.05343): each matmul C = A B of a layer runs
  SUMMA on a q x q grid: q steps, each broadcasting one block of A along its grid row and one block
  of B along its grid column, so a rank receives (q - 1) / q^2 (|A| + |B|) elements per matmul in
  forward and twice that in backward (two matmuls, dA and dB); activations and weights per rank
  fall by q^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import cast

from elixir_tune.costmodel.expert import expert_param_indices
from elixir_tune.plan.schema import ParallelPlan, PipelineAssignment, TensorMode
from elixir_tune.plan.stages import assign_stages, last_stage, stage_of_block
from elixir_tune.plan.stages import virtual_stages as stage_runs
from elixir_tune.plan.tensor_layout import grid_problem, has_table, local_shape, table_for
from elixir_tune.profiler.schema import ActivationLine, BlockInfo, ModelProfile

# Collectives per layer and micro-batch of 1D tensor parallelism with sequence parallelism: forward
# all-gather before attention and before the MLP, reduce-scatter after each; backward the reverse.
TP_1D_FORWARD_COLLECTIVES = 4
# Activation bytes per token and hidden unit of one layer (Korthikanti et al., flash attention):
# 34 in all, of which 10 stay replicated under 1D tensor parallelism without sequence parallelism.
ACTIVATION_UNITS = 34.0
REPLICATED_UNITS = 10.0
# Backward of a matmul moves twice what its forward moves under SUMMA (dA = dC B^T and dB = A^T dC).
SUMMA_BACKWARD_FACTOR = 2.0
# FLOP-efficiency rule when the hardware has no block-rate curve: a GEMM whose narrowest per-rank
# dimension is w columns runs at w / (w + TP_HALF_RATE_COLUMNS) of its rate at infinite width
# (estimate: half rate at 128 columns, ~0.98 at 5120). It only ever scales the rate relative to
# the unsplit model, so a tensor split of h columns into h / T costs eff(h / T) / eff(h).
TP_HALF_RATE_COLUMNS = 128.0


@dataclass(frozen=True)
class Layout:
    """How the world is split beside data parallelism.

    Attributes:
        pipeline: pipeline stages P.
        tensor: tensor-parallel degree T (q * q in 2d mode).
        tensor_mode: ``1d`` (Megatron) or ``2d`` (Optimus).
        assignment: blocks to stages, ``modular`` (i mod P) or ``contiguous``.
        sequence_parallel: 1d only: norms and dropout sequence-sharded.
        expert: expert degree E (``costmodel/expert.py``): each group of E data ranks holds every
            expert once; it adds no ranks.
    """

    pipeline: int = 1
    tensor: int = 1
    tensor_mode: TensorMode = "1d"
    assignment: PipelineAssignment = "modular"
    sequence_parallel: bool = True
    expert: int = 1

    @classmethod
    def of_plan(cls, parallel: ParallelPlan) -> Layout:
        """The layout a plan's ``parallel`` section describes."""
        pipeline, tensor = parallel.pipeline, parallel.tensor
        return cls(
            pipeline.stages,
            tensor.degree,
            tensor.mode,
            pipeline.assignment,
            tensor.sequence_parallel,
            parallel.expert.degree,
        )

    @property
    def model_parallel(self) -> int:
        """Ranks that share one data-parallel index: P x T."""
        return self.pipeline * self.tensor

    def data_degree(self, world_size: int) -> int:
        """The data-parallel degree D = world / (P x T)."""
        return data_degree(world_size, self.pipeline, self.tensor)

    def describe(self) -> str:
        """A short name, e.g. ``pp2 tp4(2d)`` or ``ep4``; ``dp only`` without any."""
        parts = []
        if self.pipeline > 1:
            parts.append(f"pp{self.pipeline}" + ("" if self.assignment == "modular" else "(contiguous)"))
        if self.tensor > 1:
            parts.append(f"tp{self.tensor}" + ("(2d)" if self.tensor_mode == "2d" else ""))
        if self.expert > 1:
            parts.append(f"ep{self.expert}")
        return " ".join(parts) or "dp only"


DATA_ONLY = Layout()


def data_degree(world_size: int, pipeline: int, tensor: int) -> int:
    """The data-parallel degree: world / (pipeline x tensor).

    Raises:
        ValueError: pipeline x tensor does not divide the world.
    """
    if pipeline < 1 or tensor < 1 or world_size % (pipeline * tensor):
        raise ValueError(f"pipeline {pipeline} x tensor {tensor} does not divide the world size {world_size}")
    return world_size // (pipeline * tensor)


def virtual_stages(num_blocks: int, stages: int, assignment: str) -> float:
    """Virtual stages per rank v: blocks per stage with modular assignment (each block is one), 1
    with a contiguous one."""
    if stages <= 1:
        return 1.0
    return num_blocks / stages if assignment == "modular" else 1.0


def bubble_fraction(stages: int, micro_batches: int, virtual: float) -> float:
    """Idle share of a looped breadth-first pipeline step: (P - 1) / (N v + P - 1) when N >= P.

    A rank runs each of its v virtual stages for all N micro-batches, t each. The first micro-batch
    comes back to the rank's next virtual stage P t after it left the last one, so a loop over the
    stages takes max(N, P) t: with fewer micro-batches than stages every loop waits P - N slots. The
    step spans (v - 1) max(N, P) + N + P - 1 slots (the last loop plus the fill), of which v N are busy;
    for N >= P that is (P - 1) / (N v + P - 1), and for v = 1 GPipe's (P - 1) / (N + P - 1).

    Args:
        stages: P.
        micro_batches: N per step.
        virtual: v virtual stages per rank.

    Returns:
        The fraction of the step a rank idles (0 with one stage).
    """
    if stages <= 1:
        return 0.0
    busy = micro_batches * virtual
    span = (virtual - 1) * max(micro_batches, stages) + micro_batches + stages - 1
    return 1.0 - busy / span


def p2p_sends_per_micro_batch(num_blocks: int, stages: int, assignment: str) -> float:
    """Activation sends one rank makes per micro-batch in forward (backward sends as many gradients):
    every block boundary that crosses a stage, shared out over the P ranks of the pipeline."""
    if stages <= 1 or num_blocks <= 1:
        return 0.0
    crossings = num_blocks - 1 if assignment == "modular" else stages - 1
    return crossings / stages


def tp_1d_layer_bytes(tokens: int, hidden: int, degree: int, dtype_bytes: int) -> float:
    """Bytes one rank sends per layer and micro-batch (forward + backward) under 1D tensor parallelism.

    Each of the 2 x TP_1D_FORWARD_COLLECTIVES collectives (all-gather or reduce-scatter of the
    tokens x hidden activations) moves (T - 1) / T of them through each rank (ring). Without
    sequence parallelism the 4 all-reduces move the same bytes.

    Args:
        tokens: b x s of the micro-batch.
        hidden: h.
        degree: T.
        dtype_bytes: bytes per activation element.

    Returns:
        Bytes (0 when T is 1).
    """
    if degree <= 1:
        return 0.0
    return 2 * TP_1D_FORWARD_COLLECTIVES * tokens * hidden * dtype_bytes * (degree - 1) / degree


def layer_matmuls(hidden: int, intermediate: int, heads: int, kv_heads: int, gated: bool) -> list[tuple[int, int]]:
    """(k, n) of each weight matmul of one transformer layer (the tokens are m): fused q/k/v, the
    attention output, the MLP's up (and gate) and down projections."""
    kv_width = hidden * kv_heads // heads if heads else hidden
    mlp_in = [(hidden, intermediate)] * (2 if gated else 1)
    return [(hidden, hidden + 2 * kv_width), (hidden, hidden), *mlp_in, (intermediate, hidden)]


def tp_2d_layer_elements(tokens: int, matmuls: list[tuple[int, int]], q: int) -> float:
    """Elements one rank receives per layer and micro-batch (forward + backward) under SUMMA on a q x q grid.

    Forward, per matmul C = A B (A: tokens x k, B: k x n): (q - 1) / q^2 (|A| + |B|); backward twice that.

    Args:
        tokens: b x s of the micro-batch (m).
        matmuls: (k, n) per matmul (``layer_matmuls``).
        q: grid side.

    Returns:
        Elements (0 when q is 1).
    """
    if q <= 1:
        return 0.0
    forward = sum((q - 1) / q**2 * (tokens * k + k * n) for k, n in matmuls)
    return (1 + SUMMA_BACKWARD_FACTOR) * forward


def tp_2d_layer_broadcasts(num_matmuls: int, q: int) -> int:
    """Broadcasts per layer and micro-batch under SUMMA (latency count): per matmul q steps of two,
    in forward and in each of the two backward matmuls."""
    return 0 if q <= 1 else int((1 + SUMMA_BACKWARD_FACTOR) * num_matmuls * 2 * q)


def tp_activation_factor(mode: str, degree: int, sequence_parallel: bool) -> float:
    """Share of a layer's activation memory one tensor-parallel rank keeps.

    1D with sequence parallelism and 2D: 1 / T (everything sharded); 1D without sequence
    parallelism: (10 + 24 / T) / 34 (Korthikanti et al.: norms, dropout and the layer inputs stay
    replicated).
    """
    if degree <= 1:
        return 1.0
    if mode == "1d" and not sequence_parallel:
        return (REPLICATED_UNITS + (ACTIVATION_UNITS - REPLICATED_UNITS) / degree) / ACTIVATION_UNITS
    return 1.0 / degree


def tp_boundary_factor(mode: str, degree: int, sequence_parallel: bool) -> float:
    """Share of a block's input (what checkpointing keeps and a pipeline stage sends) one rank holds:
    sequence-sharded under 1D sequence parallelism and 2D, replicated otherwise."""
    if degree <= 1 or (mode == "1d" and not sequence_parallel):
        return 1.0
    return 1.0 / degree


def tp_local_width(hidden: int, degree: int, mode: str) -> float:
    """The narrowest per-rank matrix dimension: h / T in 1D, h / q in 2D."""
    if degree <= 1:
        return float(hidden)
    return hidden / (math.isqrt(degree) if mode == "2d" else degree)


def tp_efficiency(hidden: int, degree: int, mode: str) -> float:
    """The FLOP-rate factor of the tensor-split model against the unsplit one (``TP_HALF_RATE_COLUMNS``
    rule), 1 when unsplit or the hidden size is unknown."""
    if degree <= 1 or hidden <= 0:
        return 1.0

    def efficiency(width: float) -> float:
        return width / (width + TP_HALF_RATE_COLUMNS)

    return efficiency(tp_local_width(hidden, degree, mode)) / efficiency(float(hidden))


def tensor_degrees(profile: ModelProfile, gpus_per_node: int) -> list[tuple[int, TensorMode]]:
    """Tensor-parallel (degree, mode) pairs a model allows on a node, (1, "1d") first.

    T divides the GPUs of a node (tensor traffic stays on the node's links), the attention heads
    and the key/value heads; 1D (with sequence parallelism) needs T to divide the sequence length,
    2D a square T of at least 4 (and, in the search, micro-batches that split over its q rows) and a
    table whose styles all have a grid form (``grid_problem``: not a mixture's experts). Models whose family has no tensor
    table (``plan/tensor_layout.py``), or whose profile has no head counts, get T = 1 only.
    """
    arch = profile.arch
    out: list[tuple[int, TensorMode]] = [(1, "1d")]
    if not has_table(arch.model_type, arch.tensor_layout) or not arch.num_heads:
        return out
    kv_heads = arch.num_kv_heads or arch.num_heads
    grid = not grid_problem(table_for(arch.model_type, arch.tensor_layout))  # 2d from the same table
    for degree in range(2, gpus_per_node + 1):
        if gpus_per_node % degree or arch.num_heads % degree or kv_heads % degree:
            continue
        if profile.seq_len % degree == 0:  # sequence parallelism splits every sample's tokens by T
            out.append((degree, "1d"))
        q = math.isqrt(degree)
        if grid and q * q == degree and q >= 2:
            out.append((degree, "2d"))
    return out


def pipeline_degrees(world_size: int, tensor: int, num_blocks: int) -> list[int]:
    """Pipeline degrees P the search tries: divisors of world / T, at most the number of blocks."""
    rest = world_size // tensor
    return [p for p in range(1, rest + 1) if rest % p == 0 and (p == 1 or p <= num_blocks)]


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
    """

    held_grad_numel: int = 0


def held_grad_numel(profile: ModelProfile, layout: Layout, stage: int, local_numel: dict[int, int]) -> int:
    """Gradient elements one rank of pipeline stage ``stage`` holds unsharded at a step's peak.

    The engine's pipeline step is no-sync (``engine/parallel/pipeline.py``): each parameter's gradient stays
    in ``param.grad``, in compute dtype and whole (not sharded), from its first micro-batch's
    backward until its last one's, when it is staged and reduce-scattered. Under ``looped_bfs`` (the
    search's schedule; torch's ``ScheduleLoopedBFS``) a rank runs the backwards of its virtual stages
    one after the other, all micro-batches of each, so the gradients of one virtual stage are held at
    a time: the peak is the largest virtual stage's trainable elements. ``gpipe`` and ``1f1b`` run one
    virtual stage per rank: the same formula. (``interleaved_1f1b`` with N >= 2P micro-batches holds
    every virtual stage's at once; the search never picks it, the engine reports it.)

    Block parameters go with their block's virtual stage, the others with the first virtual stage
    (used before the blocks: embeddings) or the last (final norm, head); a tied one before the blocks
    (GPT-2's ``wte``, also the head) with both, where this stage runs them.

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
        for run in targets & held.keys():
            held[run] += numel
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
        )
        for b in mine
        if b.num_params == 0 or b.first_param in new_index
    ]
    all_fwd = sum(b.fwd_flops_per_sample for b in profile.blocks)
    mine_fwd = sum(b.fwd_flops_per_sample for b in mine)
    head_flops = max(0.0, profile.flops_per_sample - 3 * all_fwd)  # embeddings, head and loss
    flops = (3 * mine_fwd + (head_flops if is_last else 0.0)) / degree
    fwd_share = mine_fwd / all_fwd if all_fwd else (1.0 if is_last else 0.0)

    def stage_line(line: ActivationLine, per_block: list[int], mine_per_block: list[int], factor: float, tail: float):
        total = sum(per_block)
        blocks_part = min(line.per_sample_bytes, total)
        share = sum(mine_per_block) / total if total else 0.0
        if is_last:
            # What lies beyond the blocks (logits and loss) stays whole under TP: the engine gathers the
            # logits before the model's own loss (the vocabulary-parallel loss is opt-in and no plan
            # field selects it); measured, benchmarks/results/tp-activations-cpu.md.
            tail = line.per_sample_bytes - blocks_part
        return _scaled_line(line, blocks_part * share * factor + tail)

    activation = stage_line(
        profile.activation,
        [b.activation_bytes_per_sample for b in profile.blocks],
        [b.activation_bytes_per_sample for b in mine],
        act_factor,
        0.0,
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
    )
    return StageProfile(**{f.name: getattr(stage_profile, f.name) for f in fields(ModelProfile)}, held_grad_numel=held)


def critical_stage(profile: ModelProfile, layout: Layout) -> int:
    """The stage whose rank holds the most parameter elements (ties: the later, which also runs the
    head and loss): the one the search sizes memory and time by."""
    if layout.pipeline <= 1:
        return 0
    sizes = [
        (sum(p.numel for p in rank_profile(profile, layout, stage).params), stage) for stage in range(layout.pipeline)
    ]
    return max(sizes)[1]


def is_gated(profile: ModelProfile) -> bool:
    """Whether the MLP is gated (Llama-style gate/up/down), read from the parameter names."""
    return any(".gate_proj." in p.name or ".w1." in p.name for p in profile.params)


def cast_mode(mode: str) -> TensorMode:
    """A checked tensor mode."""
    if mode not in ("1d", "2d"):
        raise ValueError(f"tensor mode {mode!r}: expected 1d or 2d")
    return cast(TensorMode, mode)
