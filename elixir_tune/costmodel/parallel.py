"""Pipeline and tensor parallelism in the cost model: the layout and its formulas.

The world is data x pipeline x tensor (``plan.schema.ParallelPlan``): ``D = world / (P * T)`` ranks
share each stage's chunks (the chunk engine shards over them), each rank runs the blocks of one
pipeline stage (``plan/stages.py``) with its tensor-parallel piece of every parameter
(``plan/tensor_layout.py`` ``local_shape``). ``costmodel/stage_profile.py`` turns the whole model's
profile into what one such rank holds and runs, so that the chunk layout, trace, cache simulation,
memory model and timeline of the data-parallel cost model work on it unchanged; what parallelism
adds on top (tensor-parallel collectives, the pipeline bubble, point-to-point sends, the
tied-embedding all-reduce) is counted by the functions here and priced in
``costmodel/parallel_time.py``; ``tensor_degrees`` and ``pipeline_degrees`` list what the search tries.

Sources of the formulas:

* bubble of a looped breadth-first schedule: (P - 1) / (N v + P - 1) of the step, for N
  micro-batches and v virtual stages per rank (Lamy-Poirier, "Breadth-First Pipeline Parallelism",
  arXiv 2211.05953; the same as Narayanan et al. 2021's interleaved (P - 1) / (v N) of the ideal
  time). Modular assignment gives every rank v = blocks / P virtual stages of one block; a
  contiguous one v = 1 (GPipe's (P - 1) / (N + P - 1)). ``gpipe`` and ``1f1b`` run one virtual stage
  per rank (``plan/stages.py`` ``schedule_problem``): v = 1, the same bubble (Narayanan et al. 2021:
  1F1B's bubble is GPipe's, it changes the activations held, not the idle time).
* activations held by a stage (``held_activation_copies``): breadth-first schedules (``looped_bfs``,
  ``gpipe``) run every micro-batch's forward before the first backward, so stage s holds all N
  micro-batches' activations; ``1f1b`` (torch's ``Schedule1F1B``, Megatron's non-interleaved
  schedule) runs P - s warm-up forwards before its first backward, then one forward per backward:
  at most min(N, P - s) (Narayanan et al. 2021, section 2.2).
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
from dataclasses import dataclass
from typing import cast

from elixir_tune.plan.schema import ContextMode, ParallelPlan, PipelineAssignment, PipelineSchedule, TensorMode
from elixir_tune.plan.tensor_layout import grid_problem, has_table, table_for
from elixir_tune.profiler.schema import ModelProfile

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
        schedule: the pipeline's micro-batch schedule (``plan.schema.PipelineSchedule``): what a
            stage holds (``held_activation_copies``).
        context: context degree C (``costmodel/context.py``): each rank computes 1/C of every
            sample; the chunks stay sharded over data x context (``data_degree``).
        context_mode: how a context group exchanges keys and values (``plan.schema.ContextMode``).
    """

    pipeline: int = 1
    tensor: int = 1
    tensor_mode: TensorMode = "1d"
    assignment: PipelineAssignment = "modular"
    sequence_parallel: bool = True
    expert: int = 1
    schedule: PipelineSchedule = "looped_bfs"
    context: int = 1
    context_mode: ContextMode = "ulysses"

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
            pipeline.schedule,
            parallel.context.degree,
            parallel.context.mode,
        )

    @property
    def model_parallel(self) -> int:
        """Ranks that share one data-parallel index: P x T."""
        return self.pipeline * self.tensor

    def data_degree(self, world_size: int) -> int:
        """The ranks the chunks are sharded over: world / (P x T) (data x context)."""
        return data_degree(world_size, self.pipeline, self.tensor)

    def batch_degree(self, world_size: int) -> int:
        """The shares the global batch is cut into: world / (P x T x C)."""
        return self.data_degree(world_size) // self.context

    def describe(self) -> str:
        """A short name, e.g. ``pp2 tp4(2d)`` or ``ep4``; ``dp only`` without any."""
        parts = []
        if self.pipeline > 1:
            details = [part for part in (self.assignment, self.schedule) if part not in ("modular", "looped_bfs")]
            parts.append(f"pp{self.pipeline}" + (f"({', '.join(details)})" if details else ""))
        if self.tensor > 1:
            parts.append(f"tp{self.tensor}" + ("(2d)" if self.tensor_mode == "2d" else ""))
        if self.expert > 1:
            parts.append(f"ep{self.expert}")
        if self.context > 1:
            parts.append(f"cp{self.context}" + (f"({self.context_mode})" if self.context_mode != "ulysses" else ""))
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


def held_activation_copies(schedule: str, stages: int, stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations one pipeline stage holds at its peak.

    ``1f1b``: stage s runs P - s forwards before its first backward and one forward per backward
    after, so it never holds more than min(N, P - s). ``looped_bfs`` and ``gpipe`` run all N forwards
    of a (virtual) stage before its backwards: N. ``interleaved_1f1b`` is priced at N too, an upper
    bound (its warm-up holds fewer; the search does not offer it).

    Args:
        schedule: the plan's ``parallel.pipeline.schedule``.
        stages: P.
        stage: s, 0-based.
        micro_batches: N per step.

    Returns:
        The copies (N without a pipeline: the caller decides what one rank holds then).
    """
    if stages > 1 and schedule == "1f1b":
        return max(1, min(micro_batches, stages - stage))
    return micro_batches


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


def is_gated(profile: ModelProfile) -> bool:
    """Whether the MLP is gated (Llama-style gate/up/down), read from the parameter names."""
    return any(".gate_proj." in p.name or ".w1." in p.name for p in profile.params)


def cast_mode(mode: str) -> TensorMode:
    """A checked tensor mode."""
    if mode not in ("1d", "2d"):
        raise ValueError(f"tensor mode {mode!r}: expected 1d or 2d")
    return cast(TensorMode, mode)
