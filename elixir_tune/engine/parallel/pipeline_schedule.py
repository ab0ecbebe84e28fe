"""The pipeline's micro-batch schedule: torch's, for every split of the blocks the plan allows.

Rank r of a pipeline of P stages holds virtual stages r, r + P, r + 2P, ... (``plan/stages.py``):
modular assignment puts block b on rank b mod P, one virtual stage per block; contiguous
assignment gives every rank one. That is the "loop" placement torch's multi-stage schedules
assume, but torch's ``ScheduleLoopedBFS`` also assumes every rank holds as many virtual stages as
the calling rank, so an uneven modular split (3 blocks on 2 stages: rank 0 holds blocks 0 and 2,
rank 1 block 1) gave each rank a different idea of the other's work and failed its own check.
``LoopedBFS`` lists each rank's own virtual stages instead; with an even split its order is
torch's, action for action. The shapes no torch schedule runs (``schedule_problem``: interleaved
1F1B on an uneven split, GPipe and 1F1B with several virtual stages per rank, too few
micro-batches for 1F1B) are refused by plan validation, and here again with the same reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elixir_tune.engine.comm import pipelining

MULTI_STAGE_SCHEDULES = {"looped_bfs": "ScheduleLoopedBFS", "interleaved_1f1b": "ScheduleInterleaved1F1B"}
SINGLE_STAGE_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}

_looped_bfs_class: type | None = None


def looped_bfs_class() -> type:
    """``ScheduleLoopedBFS`` for any number of virtual stages per rank (a subclass, made on first use:
    torch's pipelining package is imported only by pipeline plans)."""
    global _looped_bfs_class
    if _looped_bfs_class is not None:
        return _looped_bfs_class
    torch_pipelining = pipelining()
    schedules = torch_pipelining.schedules
    base: Any = torch_pipelining.ScheduleLoopedBFS

    class LoopedBFS(base):
        """Breadth-first: each of the rank's virtual stages runs every micro-batch's forward in turn,
        then their backwards in reverse; rank ``r``'s virtual stages are r, r + P, ... up to the last."""

        def _calculate_single_rank_operations(self, rank: int) -> list[Any]:
            action, kind = schedules._Action, schedules._ComputationType
            micro_batches = range(self._n_microbatches)
            own = range(rank, self._num_stages, self.pp_group_size)
            # The idle slots before the first forward and between forwards and backwards are torch's;
            # the runtime orders the sends and receives from the actions, so they only pace the listing.
            ops: list[Any] = [None] * rank
            for stage in own:
                ops += [action(stage, kind.FORWARD, k) for k in micro_batches]
            ops += [None] * (2 * (self.pp_group_size - 1 - rank))
            for stage in reversed(own):
                ops += [action(stage, kind.FULL_BACKWARD, k) for k in reversed(micro_batches)]
            return ops

    _looped_bfs_class = LoopedBFS
    return LoopedBFS


def make_schedule(name: str, stages: list[Any], micro_batches: int, loss_fn: Callable) -> Any:
    """This rank's schedule object for ``micro_batches`` per step.

    Args:
        name: the plan's ``parallel.pipeline.schedule``.
        stages: this rank's ``PipelineStage`` objects, in pipeline order.
        micro_batches: per step.
        loss_fn: the last virtual stage's loss (already scaled: the schedule does not scale gradients).

    Returns:
        The schedule (``step`` trains, ``eval`` runs the forwards).
    """
    torch_pipelining = pipelining()
    if name == "looped_bfs":
        return looped_bfs_class()(stages, micro_batches, loss_fn=loss_fn, scale_grads=False)
    if name in MULTI_STAGE_SCHEDULES:
        schedule_type = getattr(torch_pipelining, MULTI_STAGE_SCHEDULES[name])
        return schedule_type(stages, micro_batches, loss_fn=loss_fn, scale_grads=False)
    (stage,) = stages  # schedule_problem refused several virtual stages per rank
    schedule_type = getattr(torch_pipelining, SINGLE_STAGE_SCHEDULES[name])
    return schedule_type(stage, micro_batches, loss_fn=loss_fn, scale_grads=False)
