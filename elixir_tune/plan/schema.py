"""The plan: typed dataclasses for everything the engine reads at run time.

A plan is written by `elixir-tune search` (or by hand), checked by `validate`, and read by the
engine and the launcher. This module imports no torch, so a plan can be loaded anywhere.

These dataclasses are the single source of truth of the plan format (docs/plan.md):
types, ``Literal`` choices, bounds (``PositiveInt``, ``NonNegativeInt``, ...) and defaults here
are what ``validate`` checks and what its messages say (see ``plan/fields.py``). Cross-field
rules (batch product, chunk size a multiple of the world size, ...) live in ``plan/validate.py``.

Conventions:
    * sizes of tensors are in elements (``chunk_size``, ``numel``), sizes of memory in bytes
      (names ending in ``_bytes``), times in seconds (``_s``);
    * the world size is ``cluster.nodes * cluster.gpus_per_node`` (one process per GPU, or per CPU
      worker when ``cluster.device`` is ``cpu``); it factors as data x pipeline x tensor
      (``Plan.parallel``), and the chunks are sharded over the data-parallel part.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

from elixir_tune.plan.engine_choice import EngineChoice, changed_fields
from elixir_tune.plan.fields import Min, NonNegativeFloat, NonNegativeInt, PositiveInt

SCHEMA_VERSION = 1

Dtype = Literal["fp32", "bf16", "fp16"]
Device = Literal["cuda", "cpu"]
Backend = Literal["nccl", "gloo"]
# How the micro-batches of a step run: one after the other (standard), or block by block for all of
# them (layered gradient accumulation, Lamy-Poirier 2021: each chunk fetched once per pass per step).
Accumulation = Literal["standard", "layered"]
# What a checkpointed block keeps: its input (full) or also torchtitan's per-op saves (selective).
CheckpointMode = Literal["full", "selective"]
# What the training script runs each step (plan/capabilities.py): the plain loop of a DDP/FSDP script
# (model(**batch) + optimizer.backward per micro-batch), or model.forward_backward(micro_batches).
Loop = Literal["plain", "forward_backward"]
# Layouts a model may be unable to use (plan/capabilities.py unsupported_layouts).
LayoutName = Literal["pipeline", "tensor"]
# Pipeline stages: block i goes to stage i mod P (modular: each rank holds several non-contiguous
# blocks, Lamy-Poirier 2021) or to stage i // (N / P) (contiguous, GPipe style).
PipelineAssignment = Literal["modular", "contiguous"]
PipelineSchedule = Literal["looped_bfs", "interleaved_1f1b", "gpipe", "1f1b"]
# Tensor parallelism: Megatron's 1D (column/row-parallel linears) or Optimus's 2D (q x q grid).
TensorMode = Literal["1d", "2d"]
# How a context group exchanges keys and values: all-to-all over heads, K/V passed around a ring, or
# K/V all-gathered whole (Llama 3's form; load-balanced causal split like the ring).
ContextMode = Literal["ulysses", "ring", "allgather"]
# Keys of Prediction.model_state_bytes; the engine reports the same keys (Engine.memory_report).
#   cache_bytes:        cache_blocks gathered chunks, chunk_size elements each, compute dtype (device)
#   resident_bytes:     resident chunks, always gathered, chunk_size elements each, compute dtype (device)
#   device_shard_bytes: this rank's shards of chunks with offload false (master + grad + optim), device
#   host_shard_bytes:   this rank's shards of chunks with offload true, host memory
ModelStateKey = Literal["cache_bytes", "resident_bytes", "device_shard_bytes", "host_shard_bytes"]

DTYPES: tuple[str, ...] = get_args(Dtype)
DEVICES: tuple[str, ...] = get_args(Device)
BACKENDS: tuple[str, ...] = get_args(Backend)
ACCUMULATIONS: tuple[str, ...] = get_args(Accumulation)
CHECKPOINT_MODES: tuple[str, ...] = get_args(CheckpointMode)
LOOPS: tuple[str, ...] = get_args(Loop)
PIPELINE_ASSIGNMENTS: tuple[str, ...] = get_args(PipelineAssignment)
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
TENSOR_MODES: tuple[str, ...] = get_args(TensorMode)
MODEL_STATE_KEYS: tuple[str, ...] = get_args(ModelStateKey)
# What the engine holds beside the model states (plan/memory.py has the formula).
TransientKey = Literal["staging_bytes", "host_copy_bytes", "landing_bytes", "held_grad_bytes"]
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# Bytes per element of this rank's shard of model states, for a chunk, by optimizer: fp32 master
# weight (4) + fp32 gradient (4) + optimizer state (Adam: m and v, 8; SGD with momentum: 4).
SHARD_BYTES_PER_ELEMENT = {"adam": 16, "sgd_momentum": 12, "sgd": 8}
# Default of MemoryPlan.staging_buffers: one chunk's gradients reduce while the next one fills.
DEFAULT_STAGING_BUFFERS = 2


@dataclass
class ForeignRead:
    """Parameters one module reads in its own forward although it does not own them (a parent
    reading a child's ``.weight``, a functional call on a sibling's parameters). The engine
    gathers their chunks for this module, forward, backward and recomputation alike.

    Attributes:
        module: qualified name of the reading module ("" for the model itself).
        params: names of the parameters it reads that no running module owns.
    """

    module: str
    params: list[str]


@dataclass
class ModelInfo:
    """Which model the plan is for.

    Attributes:
        source: the model file or model YAML the plan was made from.
        fingerprint: hash of parameter names, shapes and dtypes in order; the engine refuses a
            model whose fingerprint differs.
        num_params: number of parameters (tied parameters counted once).
        name: a human name for the model.
        block_list: dotted path of the ModuleList of repeated blocks ("" when the model has none);
            activation checkpointing applies to its items.
        num_blocks: number of items in ``block_list``.
        model_type: the model family (a Hugging Face ``config.model_type``: gpt2, llama, ...; ""
            when unknown); tensor parallelism picks its per-family layout by it.
        num_heads: attention heads per block (0 when unknown).
        num_kv_heads: key/value heads per block (grouped-query attention; 0 when unknown).
        unsupported_layouts: the parallel layouts the engine cannot run for this model, each with
            the reason (``plan/capabilities.py``; from the profile); ``validate`` refuses a plan
            that uses one.
        foreign_reads: parameters read outside their own module's forward, by reading module
            (``elixir-tune profile`` finds them; empty for most models and for older plans).
        tensor_layout: the model's tensor table (``plan/tensor_layout.py``: module pattern ->
            style), from the profile; empty in older plans (the family's built-in table, or the
            engine reads it from the model).
        num_experts: experts per mixture-of-experts block when the model ships an expert plan
            (transformers' ``config.base_model_ep_plan``); 0: expert parallelism cannot run it.
        lora: the LoRA adapters the profile was made with (``elixir_tune.models.lora``: rank, alpha,
            dropout, target_modules); empty for full fine-tuning. ``setup`` refuses a model whose
            adapters differ.
    """

    source: str
    fingerprint: str
    num_params: PositiveInt
    name: str = ""
    block_list: str = ""
    num_blocks: NonNegativeInt = 0
    model_type: str = ""
    num_heads: NonNegativeInt = 0
    num_kv_heads: NonNegativeInt = 0
    unsupported_layouts: dict[LayoutName, str] = field(default_factory=dict)
    foreign_reads: list[ForeignRead] = field(default_factory=list)
    tensor_layout: dict[str, str] = field(default_factory=dict)
    lora: dict[str, Any] = field(default_factory=dict)
    num_experts: NonNegativeInt = 0


@dataclass
class ClusterInfo:
    """Where the plan runs.

    Attributes:
        hardware: hardware preset id or file the plan was searched for.
        nodes: number of nodes.
        gpus_per_node: processes per node (one per GPU; CPU workers when device is cpu).
        device: ``cuda`` or ``cpu``.
        backend: ``nccl`` (cuda) or ``gloo`` (cpu).
    """

    hardware: str
    nodes: PositiveInt
    gpus_per_node: PositiveInt
    device: Device
    backend: Backend

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Checkpointing:
    """Activation checkpointing of the model's repeated blocks.

    Attributes:
        every: 0 for none, 1 for every block, k for blocks 0, k, 2k, ...
        mode: what a checkpointed block keeps for backward: ``full`` its input only (the whole
            forward recomputes), ``selective`` also what torchtitan's per-op policy saves (every
            other matrix product's output and the attention's; ``elixir_tune.selective_checkpoint``),
            so only the rest recomputes. Left out of the file when ``full``.
    """

    every: Annotated[int, Min(0, "0 (none), 1 (all) or k > 1")] = 0
    mode: CheckpointMode = "full"

    def applies_to(self, block_index: int) -> bool:
        return self.every > 0 and block_index % self.every == 0


@dataclass
class TrainingInfo:
    """Batching and precision.

    Attributes:
        dtype: compute dtype, one of fp32, bf16, fp16 (master weights are always fp32).
        global_batch_size: samples per optimizer step over all ranks.
        micro_batch_size: samples per forward/backward on one rank.
        grad_accum_steps: micro-batches per optimizer step on one rank.
        seq_len: tokens per sample.
        activation_checkpointing: which blocks recompute their activations in backward.
        accumulation: ``standard`` runs the micro-batches one after the other; ``layered`` runs
            each block for all micro-batches before the next (``ElixirModel.forward_backward``),
            so every chunk is gathered once per forward and once per backward per step.
        loop: what the training script runs each step: ``plain`` (``model(**batch)`` and
            ``optimizer.backward(loss)`` per micro-batch) or ``forward_backward``
            (``model.forward_backward(micro_batches)`` on the slice of ``elixir_tune.data_rank()``).
            Pipeline, tensor and layered plans need ``forward_backward`` (``plan/capabilities.py``);
            None in plans written before it was recorded (the loop their layout needs).
    """

    dtype: Dtype
    global_batch_size: PositiveInt
    micro_batch_size: PositiveInt
    grad_accum_steps: PositiveInt
    seq_len: PositiveInt
    activation_checkpointing: Checkpointing = field(default_factory=Checkpointing)
    accumulation: Accumulation = "standard"
    loop: Loop | None = None


@dataclass
class PipelineParallel:
    """Pipeline parallelism: the blocks split into stages, one stage per rank of a pipeline group.

    Attributes:
        stages: pipeline degree P (1: no pipeline).
        assignment: ``modular`` puts block i on stage i mod P (several non-contiguous blocks per
            rank, breadth-first schedules keep the bubble small); ``contiguous`` gives each stage a
            run of N / P consecutive blocks.
        schedule: the micro-batch schedule (``looped_bfs``: every micro-batch through a stage's
            block before the next block, the layered order).
    """

    stages: PositiveInt = 1
    assignment: PipelineAssignment = "modular"
    schedule: PipelineSchedule = "looped_bfs"


@dataclass
class TensorParallel:
    """Tensor parallelism: each block's matrices split over the ranks of a tensor group.

    Attributes:
        degree: tensor degree T (1: none); a square q x q for mode ``2d``.
        mode: ``1d`` (Megatron: column- then row-parallel linears) or ``2d`` (Optimus: weights and
            activations split over a q x q grid).
        sequence_parallel: 1d only: norms and dropout run on sequence shards, so their
            activations are split by T too.
    """

    degree: PositiveInt = 1
    mode: TensorMode = "1d"
    sequence_parallel: bool = True


@dataclass
class ExpertParallel:
    """Expert parallelism: a mixture-of-experts model's experts spread over groups of data ranks.

    Attributes:
        degree: expert degree E (1: none): each group of E consecutive data ranks holds every expert
            once (1/E of them per rank) and sends each token to the rank holding its chosen experts;
            E divides the data size and the experts of each block. Each data rank still feeds its own
            micro-batches, so the training script is the same as without it.
    """

    degree: PositiveInt = 1


@dataclass
class ContextParallel:
    """Context (sequence) parallelism: each rank of a context group holds 1/C of every sequence.

    Attributes:
        degree: context degree C (1: none). The ranks of a context group are fed the same
            micro-batches, compute different tokens with the same weights, and exchange keys and
            values inside attention; the chunks are sharded over data x context.
        mode: ``ulysses`` (all-to-all over heads before and after attention; C divides the heads),
            ``allgather`` (each rank holds chunks i and 2C - 1 - i of 2C and gathers every rank's keys
            and values; any head count) or ``ring`` (the same split; K/V passed around the ring, overlapped
            with the attention of the block in hand; any head count).
    """

    degree: PositiveInt = 1
    mode: ContextMode = "ulysses"


@dataclass
class ParallelPlan:
    """How the world factors: data x pipeline x context x tensor.

    Ranks are laid out row-major over (data, pipeline, context, tensor): ``rank = ((data_index * P +
    stage) * C + context_index) * T + tensor_index``, so a tensor group is consecutive ranks (one
    node), a context group the next heaviest traffic, and data is outermost.

    Attributes:
        pipeline: the pipeline dimension.
        tensor: the tensor dimension.
        expert: expert parallelism inside the data dimension (it adds no ranks).
        context: the context dimension (left out of a plan file when its degree is 1).
    """

    pipeline: PipelineParallel = field(default_factory=PipelineParallel)
    tensor: TensorParallel = field(default_factory=TensorParallel)
    expert: ExpertParallel = field(default_factory=ExpertParallel)
    context: ContextParallel = field(default_factory=ContextParallel)

    @property
    def model_parallel_size(self) -> int:
        """Ranks fed the same micro-batches: P x C x T (one replica of the model is P x T of them)."""
        return self.pipeline.stages * self.context.degree * self.tensor.degree

    def data_degree(self, world_size: int) -> int:
        """The data-parallel size of a world of ``world_size`` ranks (world / (P x C x T)): how many
        shares the global batch is cut into. The chunks are sharded over data x context."""
        return world_size // self.model_parallel_size

    def is_default(self) -> bool:
        return self == ParallelPlan()


@dataclass
class ChunkPlan:
    """One chunk: a flat buffer of ``MemoryPlan.chunk_size`` elements holding whole parameters.

    Attributes:
        id: position of the chunk, 0-based, in first-use order.
        params: parameter names packed into the chunk, in order.
        numel: elements used by those parameters (the rest of the chunk is padding).
        resident: keep the gathered chunk on the device all the time (outside the cache).
        offload: this rank's shard (fp32 master, gradient, optimizer state) lives in host memory
            and its optimizer step runs on the CPU; otherwise it lives on the device.
        stage: the pipeline stage holding the chunk (``plan/stages.py`` ``assign_stages``; a chunk
            never spans stages). Written only when ``parallel.pipeline.stages`` > 1.
        frozen: the chunk holds frozen parameters (requires_grad False, e.g. a LoRA base model):
            its shard is the weights in the compute dtype only (no fp32 master, gradient or
            optimizer state) and it is never reduced; it is gathered, cached and offloaded like any
            chunk. A chunk holds frozen parameters only or trainable ones only.
    """

    id: int
    params: list[str]
    numel: PositiveInt
    resident: bool = False
    offload: bool = False
    stage: NonNegativeInt = 0
    frozen: bool = False


@dataclass
class MemoryPlan:
    """Chunking, caching and placement.

    Attributes:
        chunk_size: elements per chunk, a multiple of the data-parallel size.
        cache_blocks: gathered non-resident chunks the device holds at once.
        prefetch: chunks fetched ahead of their first use.
        staging_buffers: chunk-sized gradient buffers that backward fills and reduce-scatters from
            (a bounded pool: when none is free the oldest reduction is finished first).
        chunks: every parameter exactly once (trainable ones in ordinary chunks, frozen ones in
            frozen chunks), in first-use order.
    """

    chunk_size: PositiveInt
    cache_blocks: NonNegativeInt
    prefetch: NonNegativeInt
    # Keyword-only so that it can have a default and still be written before the long chunk list.
    staging_buffers: PositiveInt = field(default=DEFAULT_STAGING_BUFFERS, kw_only=True)
    chunks: list[ChunkPlan]


@dataclass
class StagePrediction:
    """The memory of every rank of one pipeline stage (stages hold different chunks, cache slots and
    held gradients; the tensor and data ranks of a stage hold the same).

    Attributes:
        stage: the pipeline stage, 0..P-1.
        peak_gpu_bytes: peak device memory of one rank of the stage.
        peak_host_bytes: peak host memory of a node were all its ranks of this stage.
        model_state_bytes: keys MODEL_STATE_KEYS, one rank of the stage (its ``memory_report()``).
        transient_bytes: keys TRANSIENT_KEYS, one rank of the stage.
    """

    stage: NonNegativeInt
    peak_gpu_bytes: NonNegativeInt
    peak_host_bytes: NonNegativeInt
    model_state_bytes: dict[ModelStateKey, int] = field(default_factory=dict)
    transient_bytes: dict[TransientKey, int] = field(default_factory=dict)


@dataclass
class Prediction:
    """What the cost model predicts for one optimizer step (all ranks in parallel).

    Attributes:
        step_time_s: seconds per optimizer step.
        tokens_per_s: tokens per second over the whole cluster.
        tflops_per_gpu: model TFLOP/s per GPU (recomputation not counted as useful work).
        mfu: model FLOPs utilisation against the hardware's dense matmul rate.
        peak_gpu_bytes: peak device memory of one rank.
        peak_host_bytes: peak host memory of one node.
        model_state_bytes: the model-state part of memory, keys MODEL_STATE_KEYS.
        transient_bytes: what the engine allocates beside the model states, keys TRANSIENT_KEYS
            (``elixir_tune.plan.memory``).
        breakdown: named parts of the step time in seconds (compute_s, exposed_fetch_s, ...).
        stages: with a pipeline, every stage's memory (``Plan.rank_memory`` picks a rank's); the
            memory figures above are then those of the stage with the highest device peak (the
            host peak the fullest node's: its ranks' stages summed). Empty without a pipeline.
    """

    step_time_s: NonNegativeFloat
    tokens_per_s: NonNegativeFloat
    tflops_per_gpu: NonNegativeFloat
    mfu: NonNegativeFloat
    peak_gpu_bytes: NonNegativeInt
    peak_host_bytes: NonNegativeInt
    model_state_bytes: dict[ModelStateKey, int] = field(default_factory=dict)
    transient_bytes: dict[TransientKey, int] = field(default_factory=dict)
    breakdown: dict[str, float] = field(default_factory=dict)
    stages: list[StagePrediction] = field(default_factory=list)


@dataclass
class SearchInfo:
    """How the plan was found.

    Attributes:
        strategy: name of the search strategy.
        candidates: candidates scored.
        elapsed_s: wall time of the search.
        alternatives: the next best candidates, each a flat mapping of choices and predictions.
        profile: absolute path of the profile searched from ("" when unknown); ``show --timeline``
            reads it when no ``--profile`` is given.
    """

    strategy: str
    candidates: NonNegativeInt
    elapsed_s: NonNegativeFloat
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    profile: str = ""


@dataclass
class Plan:
    """A complete plan (``schema_version`` 1)."""

    model: ModelInfo
    cluster: ClusterInfo
    training: TrainingInfo
    memory: MemoryPlan
    parallel: ParallelPlan = field(default_factory=ParallelPlan)
    engine: EngineChoice = field(default_factory=EngineChoice)
    prediction: Prediction | None = None
    search: SearchInfo | None = None
    schema_version: int = SCHEMA_VERSION

    @property
    def world_size(self) -> int:
        """Every process of the run (data x pipeline x context x tensor)."""
        return self.cluster.world_size

    @property
    def data_parallel_size(self) -> int:
        """The shares the global batch is cut into (world / (P x C x T)); without context
        parallelism also the ranks each chunk is sharded over (``shard_group_size``)."""
        return self.parallel.data_degree(self.cluster.world_size)

    @property
    def shard_group_size(self) -> int:
        """The ranks each chunk is sharded over: data x context (the ranks of a context group
        compute different tokens with the same weights, so their gradients reduce together)."""
        return self.data_parallel_size * self.parallel.context.degree

    def stage_of_rank(self, rank: int) -> int:
        """The pipeline stage of a global rank (ranks are laid out data x pipeline x tensor, row-major)."""
        return rank // (self.parallel.tensor.degree * self.parallel.context.degree) % self.parallel.pipeline.stages

    def rank_memory(self, rank: int) -> StagePrediction:
        """What the plan promises rank ``rank`` holds: its stage's entry of ``prediction.stages``, or
        the prediction's own figures when it has none (no pipeline: every rank holds the same).

        Raises:
            ValueError: the plan has no prediction, or the rank is outside the world.
        """
        if self.prediction is None:
            raise ValueError("the plan has no prediction section: make it with `elixir-tune search`")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the plan's world of {self.world_size} ranks")
        stage = self.stage_of_rank(rank)
        for entry in self.prediction.stages:
            if entry.stage == stage:
                return entry
        pred = self.prediction
        return StagePrediction(
            stage, pred.peak_gpu_bytes, pred.peak_host_bytes, dict(pred.model_state_bytes), dict(pred.transient_bytes)
        )

    def chunk_of(self) -> dict[str, int]:
        """Maps each parameter name to the id of the chunk holding it."""
        return {name: chunk.id for chunk in self.memory.chunks for name in chunk.params}

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain Python objects, sections in reading order, empty optional sections left out."""
        raw: dict[str, Any] = {"schema_version": self.schema_version}
        for name in ("model", "cluster", "parallel", "engine", "training", "memory", "prediction", "search"):
            value = getattr(self, name)
            # Without pipeline or tensor parallelism, or on our own engine, the section is left out:
            # such plans read as before.
            if value is not None and not (name == "parallel" and self.parallel.is_default()):
                if name == "engine":
                    if value != EngineChoice():  # only what differs from the defaults, name first
                        raw[name] = {"name": value.name, **changed_fields(value, EngineChoice())}
                    continue
                raw[name] = dataclasses.asdict(value)
        if "parallel" in raw and self.parallel.context == ContextParallel():
            del raw["parallel"]["context"]  # no context parallelism: the file reads as before it
        if self.parallel.pipeline.stages == 1:
            for chunk in raw["memory"]["chunks"]:
                del chunk["stage"]  # every chunk is on the one stage: the file reads as before pipelines
        # Without frozen parameters (full fine-tuning) the file reads as before LoRA.
        for chunk in raw["memory"]["chunks"]:
            if not chunk["frozen"]:
                del chunk["frozen"]
        if not raw["model"]["lora"]:
            del raw["model"]["lora"]
        if self.training.activation_checkpointing.mode == "full":
            del raw["training"]["activation_checkpointing"]["mode"]  # the file reads as before selective
        if "prediction" in raw and not raw["prediction"]["stages"]:
            del raw["prediction"]["stages"]  # no pipeline: the file reads as before per-stage memory
        return raw
