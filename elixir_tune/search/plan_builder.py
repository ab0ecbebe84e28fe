"""Turning a scored candidate into a Plan the engine can run.

With a pipeline, each stage's parameters are packed into chunks of their own (``ChunkPlan.stage``;
chunks never cross stages), at the tensor-parallel local sizes when there is tensor parallelism.
The search scored the critical stage (``costmodel.parallel.critical_stage``); every other stage
gets the same chunk size, cache and offload share (its cache capped to its chunks, more offloaded
if it would not fit), and the plan's prediction is the slowest stage's step and the largest peaks.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import cast

from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.costmodel.parallel import tied_params
from elixir_tune.plan.schema import (
    Backend,
    Checkpointing,
    ChunkPlan,
    ClusterInfo,
    Device,
    Dtype,
    MemoryPlan,
    ModelInfo,
    ModelStateKey,
    ParallelPlan,
    PipelineParallel,
    Plan,
    Prediction,
    SearchInfo,
    TensorParallel,
    TrainingInfo,
    TransientKey,
)
from elixir_tune.search.candidate import Candidate, score

BACKEND_OF_DEVICE: dict[str, Backend] = {"cuda": "nccl", "cpu": "gloo"}


def stage_shape(stage_model: CostModel, shape: Shape, critical_chunks: int, usable_gpu_bytes: int) -> Shape:
    """The critical stage's shape carried over to another stage of the same layout.

    Args:
        stage_model: the cost model of that stage.
        shape: the critical stage's shape.
        critical_chunks: chunks of the critical stage (for the offload share).
        usable_gpu_bytes: device memory a rank may fill.

    Returns:
        The stage's shape: cache capped to its chunks (never under its minimum), the same offload
        share rounded up, more offloaded while it does not fit.
    """
    layout = stage_model.layout(shape.chunk_size)
    minimum = stage_model.min_cache_blocks(shape.chunk_size, shape.every)
    cache = max(min(shape.cache_blocks, layout.num_cacheable), minimum)
    room = cache - minimum if cache < layout.num_cacheable else cache - 1
    count = min(layout.num_chunks, math.ceil(shape.num_offloaded / max(1, critical_chunks) * layout.num_chunks))
    out = replace(shape, cache_blocks=cache, prefetch=max(0, min(shape.prefetch, room)), num_offloaded=count)
    while count < layout.num_chunks and stage_model.memory(out).required_gpu_bytes > usable_gpu_bytes:
        count += 1
        out = replace(out, num_offloaded=count)
    return out


def stage_candidates(
    model: CostModel, candidate: Candidate, global_batch_size: int
) -> list[tuple[CostModel, Candidate]]:
    """(cost model, scored candidate) of every pipeline stage, the critical one as searched."""
    layout = model.parallel_layout
    if layout.pipeline == 1:
        return [(model, candidate)]
    out = []
    critical_chunks = model.layout(candidate.shape.chunk_size).num_chunks
    usable = model.hardware.usable_memory_bytes
    for stage in range(layout.pipeline):
        if stage == model.stage:
            out.append((model, candidate))
            continue
        other = CostModel(
            model.full_profile, model.hardware, model.gpus_per_node, model.nodes, model.dtype, layout, stage=stage
        )
        shape = stage_shape(other, candidate.shape, critical_chunks, usable)
        out.append((other, score(other, shape, other.memory(shape), global_batch_size)))
    return out


def _chunks(stages: list[tuple[CostModel, Candidate]]) -> list[ChunkPlan]:
    """Every stage's chunks, numbered in stage order. A tied parameter that the last stage also holds
    is listed once, in the first stage's chunk (the engine gives the last stage its copy)."""
    chunks: list[ChunkPlan] = []
    first_model = stages[0][0]
    tied = {
        first_model.full_profile.params[i].name
        for i in tied_params(first_model.full_profile, first_model.parallel_layout)
    }
    for stage, (model, candidate) in enumerate(stages):
        offloaded = model.offload_mask(candidate.shape)
        profile = model.profile
        for index, chunk in enumerate(model.layout(candidate.shape.chunk_size).chunks):
            names = [profile.params[i].name for i in chunk.params]
            if stage > 0 and tied.issuperset(names):
                continue
            chunks.append(
                ChunkPlan(
                    id=len(chunks),
                    params=names,
                    numel=chunk.numel,
                    resident=chunk.resident,
                    offload=offloaded[index],
                    stage=stage,
                )
            )
    return chunks


def build_plan(
    model: CostModel,
    candidate: Candidate,
    *,
    hardware_id: str,
    global_batch_size: int,
    strategy: str,
    elapsed_s: float,
    num_scored: int,
    alternatives: list[Candidate],
) -> Plan:
    """The plan of one candidate, with its prediction and how it was found.

    Args:
        model: the cost model it was scored with (of its parallel layout).
        candidate: the chosen candidate.
        hardware_id: preset id or file name recorded in ``cluster.hardware``.
        global_batch_size: samples per step over all ranks.
        strategy: search strategy name.
        elapsed_s: search wall time.
        num_scored: candidates scored.
        alternatives: the runners-up, best first.

    Returns:
        The plan.
    """
    profile = model.full_profile
    shape = candidate.shape
    stages = stage_candidates(model, candidate, global_batch_size)
    slowest = max((c for _, c in stages), key=lambda c: c.step_time_s)
    peak_gpu = max(c.memory.peak_gpu_bytes for _, c in stages)
    peak_host = max(c.memory.peak_host_bytes for _, c in stages)
    prediction = Prediction(
        step_time_s=round(slowest.step_time_s, 6),
        tokens_per_s=round(slowest.tokens_per_s, 3),
        tflops_per_gpu=round(slowest.tflops_per_gpu, 4),
        mfu=round(slowest.mfu, 4),
        peak_gpu_bytes=int(peak_gpu),
        peak_host_bytes=int(peak_host),
        # The cost model's keys are MODEL_STATE_KEYS by construction (costmodel.memory.model_state_bytes).
        model_state_bytes=cast("dict[ModelStateKey, int]", dict(candidate.memory.model_state_bytes)),
        transient_bytes=cast("dict[TransientKey, int]", dict(candidate.memory.transient_bytes)),
        breakdown={key: round(value, 6) for key, value in slowest.estimate.breakdown.items()},
    )
    device = model.hardware.device
    layout = model.parallel_layout
    arch = profile.arch
    return Plan(
        model=ModelInfo(
            source=profile.source,
            fingerprint=profile.fingerprint,
            num_params=profile.num_params,
            name=profile.name,
            block_list=profile.block_list if profile.blocks else "",
            num_blocks=len(profile.blocks),
            model_type=arch.model_type,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            foreign_reads=[replace(read, params=list(read.params)) for read in profile.foreign_reads],
        ),
        cluster=ClusterInfo(
            hardware=hardware_id,
            nodes=model.nodes,
            gpus_per_node=model.gpus_per_node,
            device=cast(Device, device),  # a HardwareSpec's device is checked against DEVICES when loaded
            backend=BACKEND_OF_DEVICE.get(device, "gloo"),
        ),
        parallel=ParallelPlan(
            pipeline=PipelineParallel(stages=layout.pipeline, assignment=layout.assignment),
            tensor=TensorParallel(
                degree=layout.tensor, mode=layout.tensor_mode, sequence_parallel=layout.sequence_parallel
            ),
        ),
        training=TrainingInfo(
            dtype=cast(Dtype, model.dtype),  # the profile's dtype or a --fix dtype checked by parse_fixed
            global_batch_size=global_batch_size,
            micro_batch_size=shape.micro_batch_size,
            grad_accum_steps=shape.grad_accum_steps,
            seq_len=profile.seq_len,
            activation_checkpointing=Checkpointing(every=shape.every),
            accumulation=shape.accumulation,
        ),
        memory=MemoryPlan(
            chunk_size=shape.chunk_size,
            cache_blocks=shape.cache_blocks,
            prefetch=shape.prefetch,
            chunks=_chunks(stages),
            staging_buffers=shape.staging_buffers,
        ),
        prediction=prediction,
        search=SearchInfo(
            strategy=strategy,
            candidates=num_scored,
            elapsed_s=round(elapsed_s, 3),
            alternatives=[alt.row() for alt in alternatives],
        ),
    )
