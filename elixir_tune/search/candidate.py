"""A scored candidate: its shape, predicted memory and time, and the figures a user compares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elixir_tune.costmodel.memory import MemoryEstimate
from elixir_tune.costmodel.model import CostModel, Shape, StepEstimate
from elixir_tune.costmodel.parallel import DATA_ONLY, Layout
from elixir_tune.plan.schema import DTYPE_BYTES


@dataclass
class Candidate:
    """One plan shape with its prediction.

    Attributes:
        shape: the choices.
        num_chunks: chunks of its chunk size (resident ones included).
        num_cacheable: non-resident chunks.
        dtype: compute dtype.
        memory: predicted peaks.
        estimate: predicted step time and breakdown.
        tokens_per_s: cluster throughput.
        tflops_per_gpu: model TFLOP/s per GPU (recomputation not counted).
        mfu: against the hardware's dense peak for the dtype (its achieved matmul rate when unknown).
        layout: pipeline and tensor parallelism of the cost model it was scored with.
    """

    shape: Shape
    num_chunks: int
    num_cacheable: int
    dtype: str
    memory: MemoryEstimate
    estimate: StepEstimate
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    layout: Layout = DATA_ONLY

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s

    @property
    def offload_share(self) -> float:
        return self.shape.num_offloaded / self.num_chunks if self.num_chunks else 0.0

    def rank_key(self, gpu_bytes: int | None = None, host_bytes: int | None = None) -> tuple[float, int, int, int, int]:
        """What the search ranks by, smaller first: the predicted step, then the looped breadth-first
        schedule before 1F1B (a pipeline keeps its schedule when 1F1B gains no time), then fewer
        offloaded shards, then less device and host memory. The plausibility bound is no key: it
        never replaces a prediction (``CostModel._bounded``), so no plans tie at it.

        Args:
            gpu_bytes: device bytes to compare (default: the predicted peak).
            host_bytes: host bytes to compare (default: the predicted peak).
        """
        return (
            self.step_time_s,
            0 if self.layout.schedule == "looped_bfs" else 1,
            self.shape.num_offloaded,
            self.memory.peak_gpu_bytes if gpu_bytes is None else gpu_bytes,
            self.memory.peak_host_bytes if host_bytes is None else host_bytes,
        )

    def row(self) -> dict[str, Any]:
        """A flat mapping of choices and predictions (plan ``search.alternatives``, tables, JSON)."""
        s = self.shape
        row: dict[str, Any] = {
            "chunk_size": s.chunk_size,
            "chunk_mib": round(s.chunk_size * DTYPE_BYTES[self.dtype] / 2**20, 3),
            "cache_blocks": s.cache_blocks,
            "cacheable_chunks": self.num_cacheable,
            "offload": round(self.offload_share, 4),
            "offloaded_chunks": s.num_offloaded,
            "num_chunks": self.num_chunks,
            "prefetch": s.prefetch,
            "checkpointing": s.every,
            "micro_batch_size": s.micro_batch_size,
            "grad_accum_steps": s.grad_accum_steps,
            "accumulation": s.accumulation,
            "pipeline": self.layout.pipeline,
            "tensor": self.layout.tensor,
            "tensor_mode": self.layout.tensor_mode,
            "expert": self.layout.expert,
            "schedule": self.layout.schedule,
            "context": self.layout.context,
            "context_mode": self.layout.context_mode,
            "step_time_s": round(self.step_time_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "tflops_per_gpu": round(self.tflops_per_gpu, 3),
            "mfu": round(self.mfu, 4),
            "peak_gpu_bytes": self.memory.peak_gpu_bytes,
            "peak_host_bytes": self.memory.peak_host_bytes,
        }
        if s.selective:  # rows of fully checkpointed plans read as before selective existed
            row["checkpoint_mode"] = s.checkpoint_mode
        return row


def score(model: CostModel, shape: Shape, memory: MemoryEstimate, global_batch_size: int) -> Candidate:
    """Simulates a candidate's step and derives its throughput figures.

    Args:
        model: the cost model.
        shape: the choices.
        memory: its memory estimate (already checked to fit).
        global_batch_size: samples per step over all ranks.

    Returns:
        The scored candidate.
    """
    return score_with(model, shape, memory, model.step_time(shape), global_batch_size)


def score_with(
    model: CostModel, shape: Shape, memory: MemoryEstimate, estimate: StepEstimate, global_batch_size: int
) -> Candidate:
    """``score`` with the step already predicted (a peer engine's, ``search/peers.py``)."""
    layout = model.layout(shape.chunk_size)
    profile = model.full_profile  # the whole model's FLOPs over every GPU of the world
    step_s = estimate.step_time_s
    tflops = profile.flops_per_sample * global_batch_size / model.world_size / step_s / 1e12
    # MFU against the datasheet peak when the spec has it, else against the measured matmul rate.
    hardware = model.hardware
    peak_tflops = (
        hardware.matmul_peak_tflops.get(model.dtype)
        or hardware.matmul_tflops.get(model.dtype)
        or hardware.compute_tflops(model.dtype)
    )
    return Candidate(
        shape=shape,
        num_chunks=layout.num_chunks,
        num_cacheable=layout.num_cacheable,
        dtype=model.dtype,
        memory=memory,
        estimate=estimate,
        tokens_per_s=global_batch_size * profile.seq_len / step_s,
        tflops_per_gpu=tflops,
        mfu=tflops / peak_tflops,
        layout=model.parallel_layout,
    )
