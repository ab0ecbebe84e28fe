"""One candidate's choices (``Shape``) and its predicted step time (``StepEstimate``): what the search
varies and what the cost model (``costmodel/model.py``) answers."""

from __future__ import annotations

from dataclasses import dataclass

from elixir_tune.costmodel.memory import STAGING_BUFFERS
from elixir_tune.plan.schema import Accumulation, CheckpointMode, Plan


@dataclass
class Shape:
    """The choices that make one candidate.

    Attributes:
        chunk_size: elements per chunk.
        cache_blocks: gathered non-resident chunks held at once.
        num_offloaded: chunks whose shard lives on the host (the first ones of ``offload_order``).
        prefetch: fetches issued ahead.
        every: checkpointing (0 none, k every k-th block).
        micro_batch_size: samples per micro-batch.
        grad_accum_steps: micro-batches per step.
        offloaded: explicit chunk ids to offload instead of the first ``num_offloaded`` of
            ``CostModel.offload_order`` (a baseline strategy places shards its own way).
        layered: layered gradient accumulation (plan ``training.accumulation: layered``): the
            micro-batches run layer by layer, so the step fetches and reduces each chunk as one
            micro-batch does, and holds the activations of all micro-batches at once.
        staging_buffers: the gradient staging pool.
        selective: the checkpointed blocks keep what torchtitan's per-op policy saves (plan
            ``activation_checkpointing.mode: selective``); False: they keep their input only.
    """

    chunk_size: int
    cache_blocks: int
    num_offloaded: int
    prefetch: int
    every: int
    micro_batch_size: int
    grad_accum_steps: int
    offloaded: tuple[int, ...] | None = None
    staging_buffers: int = STAGING_BUFFERS
    layered: bool = False
    selective: bool = False

    @classmethod
    def of_plan(cls, plan: Plan, num_offloaded: int, offloaded: tuple[int, ...] | None = None) -> Shape:
        """The shape a plan's memory and training sections describe.

        Args:
            plan: the plan.
            num_offloaded: offloaded chunks of the modelled rank (a pipeline stage holds only its own).
            offloaded: their ids in the cost model's packing, when known (else the first of
                ``CostModel.offload_order``).
        """
        memory, training = plan.memory, plan.training
        return cls(
            memory.chunk_size,
            memory.cache_blocks,
            num_offloaded,
            memory.prefetch,
            training.activation_checkpointing.every,
            training.micro_batch_size,
            training.grad_accum_steps,
            offloaded=offloaded,
            staging_buffers=memory.staging_buffers,
            layered=training.accumulation == "layered",
            selective=training.activation_checkpointing.mode == "selective",
        )

    @property
    def checkpoint_mode(self) -> CheckpointMode:
        """The plan's ``activation_checkpointing.mode`` value of this shape."""
        return "selective" if self.selective else "full"

    @property
    def accumulation(self) -> Accumulation:
        """The plan's ``training.accumulation`` value of this shape."""
        return "layered" if self.layered else "standard"

    @property
    def passes_per_step(self) -> int:
        """Forward+backward passes whose chunk traffic the step pays: one when layered."""
        return 1 if self.layered else self.grad_accum_steps


@dataclass
class StepEstimate:
    """Predicted step time of one candidate.

    Attributes:
        step_time_s: seconds per optimizer step.
        breakdown: named parts in seconds.
    """

    step_time_s: float
    breakdown: dict[str, float]
