"""Turning a scored candidate into a Plan the engine can run."""

from __future__ import annotations

from typing import cast

from elixir_tune.costmodel.model import CostModel
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
    Plan,
    Prediction,
    SearchInfo,
    TrainingInfo,
    TransientKey,
)
from elixir_tune.search.candidate import Candidate

BACKEND_OF_DEVICE: dict[str, Backend] = {"cuda": "nccl", "cpu": "gloo"}


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
        model: the cost model it was scored with.
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
    profile = model.profile
    shape = candidate.shape
    layout = model.layout(shape.chunk_size)
    offloaded = model.offload_mask(shape)
    chunks = [
        ChunkPlan(
            id=index,
            params=[profile.params[i].name for i in chunk.params],
            numel=chunk.numel,
            resident=chunk.resident,
            offload=offloaded[index],
        )
        for index, chunk in enumerate(layout.chunks)
    ]
    prediction = Prediction(
        step_time_s=round(candidate.step_time_s, 6),
        tokens_per_s=round(candidate.tokens_per_s, 3),
        tflops_per_gpu=round(candidate.tflops_per_gpu, 4),
        mfu=round(candidate.mfu, 4),
        peak_gpu_bytes=int(candidate.memory.peak_gpu_bytes),
        peak_host_bytes=int(candidate.memory.peak_host_bytes),
        # The cost model's keys are MODEL_STATE_KEYS by construction (costmodel.memory.model_state_bytes).
        model_state_bytes=cast("dict[ModelStateKey, int]", dict(candidate.memory.model_state_bytes)),
        transient_bytes=cast("dict[TransientKey, int]", dict(candidate.memory.transient_bytes)),
        breakdown={key: round(value, 6) for key, value in candidate.estimate.breakdown.items()},
    )
    device = model.hardware.device
    return Plan(
        model=ModelInfo(
            source=profile.source,
            fingerprint=profile.fingerprint,
            num_params=profile.num_params,
            name=profile.name,
            block_list=profile.block_list if profile.blocks else "",
            num_blocks=len(profile.blocks),
        ),
        cluster=ClusterInfo(
            hardware=hardware_id,
            nodes=model.nodes,
            gpus_per_node=model.gpus_per_node,
            device=cast(Device, device),  # a HardwareSpec's device is checked against DEVICES when loaded
            backend=BACKEND_OF_DEVICE.get(device, "gloo"),
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
            chunks=chunks,
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
