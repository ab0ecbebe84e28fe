"""Turning a scored candidate into a Plan the engine can run.

With a pipeline, each stage's parameters are packed into chunks of their own (``ChunkPlan.stage``;
chunks never cross stages), at the tensor-parallel local sizes when there is tensor parallelism.
The search scored every stage (``search/stages.py``: the critical stage's chunk size, cache and
offload share carried over, more offloaded where a stage would not fit); the plan's prediction is
the slowest stage's step and the memory of the stage that needs the most device memory.
Under expert parallelism the expert tensors are in chunks of their own at their local size (1/E of
the experts), as the engine requires, and those chunks are never offloaded where it cannot.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

from elixir_tune.costmodel.memory import node_host_peak_bytes
from elixir_tune.costmodel.model import CostModel
from elixir_tune.costmodel.stage_profile import tied_params
from elixir_tune.plan.schema import (
    Backend,
    Checkpointing,
    ChunkPlan,
    ClusterInfo,
    ContextParallel,
    Device,
    Dtype,
    ExpertParallel,
    LayoutName,
    Loop,
    MemoryPlan,
    ModelInfo,
    ModelStateKey,
    ParallelPlan,
    PipelineParallel,
    Plan,
    Prediction,
    SearchInfo,
    StagePrediction,
    TensorParallel,
    TrainingInfo,
    TransientKey,
)
from elixir_tune.search.candidate import Candidate
from elixir_tune.search.stages import PipelineCandidate, StageScorer

BACKEND_OF_DEVICE: dict[str, Backend] = {"cuda": "nccl", "cpu": "gloo"}


def stage_candidates(
    model: CostModel, candidate: Candidate, global_batch_size: int, usable_gpu_bytes: int | None = None
) -> list[tuple[CostModel, Candidate]]:
    """(cost model, scored candidate) of every pipeline stage, the critical one as searched (the
    search's own when it scored them, ``stages.PipelineCandidate``)."""
    if isinstance(candidate, PipelineCandidate) and candidate.stages:
        return list(candidate.stages)
    usable = model.hardware.usable_memory_bytes if usable_gpu_bytes is None else usable_gpu_bytes
    return StageScorer(model).stages(candidate, global_batch_size, usable)


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
                    frozen=chunk.frozen,
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
    loop: str = "plain",
    usable_gpu_bytes: int | None = None,
    profile_path: str = "",
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
        loop: the training script's loop (``training.loop``: plain or forward_backward).
        usable_gpu_bytes: device memory a rank may fill (default: the hardware's).
        profile_path: the profile searched from, recorded in ``search.profile`` (for ``show --timeline``).

    Returns:
        The plan.
    """
    profile = model.full_profile
    shape = candidate.shape
    stages = stage_candidates(model, candidate, global_batch_size, usable_gpu_bytes)
    slowest = max((c for _, c in stages), key=lambda c: c.step_time_s)
    # Every memory figure of the prediction is one stage's: the one with the highest device peak (so
    # that its parts add up to its peak); the host peak is the fullest node's. Each stage's own
    # figures follow in ``stages``: what each of its ranks' ``memory_report()`` says.
    largest = max((c for _, c in stages), key=lambda c: (c.memory.peak_gpu_bytes, c.memory.required_gpu_bytes)).memory
    # The fullest node's host bytes: a node holds ranks of several stages when G > T.
    peak_host = node_host_peak_bytes(
        [c.memory.peak_host_bytes for _, c in stages], model.gpus_per_node, model.nodes, model.parallel_layout.tensor
    )
    prediction = Prediction(
        step_time_s=round(slowest.step_time_s, 6),
        tokens_per_s=round(slowest.tokens_per_s, 3),
        tflops_per_gpu=round(slowest.tflops_per_gpu, 4),
        mfu=round(slowest.mfu, 4),
        peak_gpu_bytes=int(largest.peak_gpu_bytes),
        peak_host_bytes=int(peak_host),
        # The cost model's keys are MODEL_STATE_KEYS by construction (costmodel.memory.model_state_bytes).
        model_state_bytes=cast("dict[ModelStateKey, int]", dict(largest.model_state_bytes)),
        transient_bytes=cast("dict[TransientKey, int]", dict(largest.transient_bytes)),
        breakdown={key: round(value, 6) for key, value in slowest.estimate.breakdown.items()},
        stages=[
            StagePrediction(
                stage=stage,
                peak_gpu_bytes=int(c.memory.peak_gpu_bytes),
                peak_host_bytes=int(c.memory.peak_host_bytes),
                model_state_bytes=cast("dict[ModelStateKey, int]", dict(c.memory.model_state_bytes)),
                transient_bytes=cast("dict[TransientKey, int]", dict(c.memory.transient_bytes)),
            )
            for stage, (_, c) in enumerate(stages)
        ]
        if len(stages) > 1
        else [],
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
            unsupported_layouts=cast("dict[LayoutName, str]", profile.layout_reasons()),
            foreign_reads=[replace(read, params=list(read.params)) for read in profile.foreign_reads],
            tensor_layout=dict(arch.tensor_layout),
            lora=dict(profile.lora),
            num_experts=arch.num_experts,
        ),
        cluster=ClusterInfo(
            hardware=hardware_id,
            nodes=model.nodes,
            gpus_per_node=model.gpus_per_node,
            device=cast(Device, device),  # a HardwareSpec's device is checked against DEVICES when loaded
            backend=BACKEND_OF_DEVICE.get(device, "gloo"),
        ),
        parallel=ParallelPlan(
            pipeline=PipelineParallel(stages=layout.pipeline, assignment=layout.assignment, schedule=layout.schedule),
            tensor=TensorParallel(
                degree=layout.tensor, mode=layout.tensor_mode, sequence_parallel=layout.sequence_parallel
            ),
            expert=ExpertParallel(degree=layout.expert),
            context=ContextParallel(degree=layout.context, mode=layout.context_mode),
        ),
        training=TrainingInfo(
            dtype=cast(Dtype, model.dtype),  # the profile's dtype or a --fix dtype checked by parse_fixed
            global_batch_size=global_batch_size,
            micro_batch_size=shape.micro_batch_size,
            grad_accum_steps=shape.grad_accum_steps,
            seq_len=profile.seq_len,
            activation_checkpointing=Checkpointing(every=shape.every, mode=shape.checkpoint_mode),
            accumulation=shape.accumulation,
            loop=cast(Loop, loop),  # checked by the driver against LOOPS
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
            profile=profile_path,
        ),
    )
