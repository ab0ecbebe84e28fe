"""A pipeline candidate judged by all of its stages, not by the one the search sizes it by.

The search explores a pipeline layout with the cost model of its critical stage (the rank holding
the most parameters). Another stage can still be slower (it runs the output head and loss) or
need more memory (its share of the activations), so a candidate that would enter the ranking is
carried over to every stage (``stage_shape``: the same chunk size, cache and offload share, more
offloaded where a stage would not fit) and scored there. Its step is the slowest stage's, its
memory the stage with the highest device peak (host: the fullest node's, its ranks' stages summed), and it is
dropped when any stage overflows the device or the host. The critical stage's own score is a
lower bound of that step, so the search's pruning stays valid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from elixir_tune.costmodel.memory import node_host_peak_bytes
from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.search.candidate import Candidate, score


def stage_shape(stage_model: CostModel, shape: Shape, critical_chunks: int, usable_gpu_bytes: int) -> Shape:
    """The critical stage's shape carried over to another stage of the same layout.

    Args:
        stage_model: the cost model of that stage.
        shape: the critical stage's shape.
        critical_chunks: chunks of the critical stage (for the offload share).
        usable_gpu_bytes: device memory a rank may fill.

    Returns:
        The stage's shape: cache capped to its chunks (never under its minimum), the same offload
        share rounded up, more offloaded while it does not fit (it may still not fit with every
        shard offloaded: the caller checks).
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


@dataclass
class PipelineCandidate(Candidate):
    """A pipeline candidate with every stage's own score.

    Attributes:
        stages: (cost model, scored candidate) per stage, in stage order; the critical stage's is
            the searched one.
    """

    stages: tuple[tuple[CostModel, Candidate], ...] = ()


class StageScorer:
    """Scores candidates of one pipeline layout on every stage (the stages' cost models are kept,
    so their chunk layouts, traces and cache simulations are shared between candidates)."""

    def __init__(self, model: CostModel):
        self.model = model
        layout = model.parallel_layout
        self._models: dict[int, CostModel] = {model.stage: model}
        self._stages = range(layout.pipeline)

    def stage_model(self, stage: int) -> CostModel:
        """The cost model of one stage (created on first use)."""
        if stage not in self._models:
            m = self.model
            self._models[stage] = CostModel(
                m.full_profile, m.hardware, m.gpus_per_node, m.nodes, m.dtype, m.parallel_layout, stage=stage
            )
        return self._models[stage]

    def stages(
        self, candidate: Candidate, global_batch_size: int, usable_gpu_bytes: int
    ) -> list[tuple[CostModel, Candidate]]:
        """(cost model, scored candidate) of every stage, the critical one as searched."""
        if self.model.parallel_layout.pipeline <= 1:
            return [(self.model, candidate)]
        critical_chunks = self.model.layout(candidate.shape.chunk_size).num_chunks
        out = []
        for stage in self._stages:
            if stage == self.model.stage:
                out.append((self.model, candidate))
                continue
            other = self.stage_model(stage)
            shape = stage_shape(other, candidate.shape, critical_chunks, usable_gpu_bytes)
            out.append((other, score(other, shape, other.memory(shape), global_batch_size)))
        return out

    def whole(
        self, candidate: Candidate, global_batch_size: int, usable_gpu_bytes: int, host_bytes: int
    ) -> Candidate | None:
        """The candidate as the whole pipeline runs it, or None when a stage does not fit.

        Args:
            candidate: the critical stage's scored candidate (already checked to fit).
            global_batch_size: samples per step.
            usable_gpu_bytes: device memory a rank may fill.
            host_bytes: host memory of a node.

        Returns:
            A ``PipelineCandidate``: the slowest stage's step and throughput, the memory of the
            stage with the highest device peak with the fullest node's host peak.
        """
        if self.model.parallel_layout.pipeline <= 1:
            return candidate
        stages = self.stages(candidate, global_batch_size, usable_gpu_bytes)
        # The fullest node's host bytes: a node holds ranks of several stages when G > T.
        peak_host = node_host_peak_bytes(
            [c.memory.peak_host_bytes for _, c in stages],
            self.model.gpus_per_node,
            self.model.nodes,
            self.model.parallel_layout.tensor,
        )
        if peak_host > host_bytes or any(c.memory.required_gpu_bytes > usable_gpu_bytes for _, c in stages):
            return None
        # The slowest stage's step (``Candidate.rank_key``) speaks for the pipeline.
        slowest = max((c for _, c in stages), key=lambda c: c.rank_key()[:1])
        largest = max((c for _, c in stages), key=lambda c: (c.memory.peak_gpu_bytes, c.memory.required_gpu_bytes))
        return PipelineCandidate(
            shape=candidate.shape,
            num_chunks=candidate.num_chunks,
            num_cacheable=candidate.num_cacheable,
            dtype=candidate.dtype,
            memory=replace(largest.memory, peak_host_bytes=peak_host),
            estimate=slowest.estimate,
            tokens_per_s=slowest.tokens_per_s,
            tflops_per_gpu=slowest.tflops_per_gpu,
            mfu=slowest.mfu,
            layout=candidate.layout,
            stages=tuple(stages),
        )
