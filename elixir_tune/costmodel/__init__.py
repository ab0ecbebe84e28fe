"""Cost model: peak device and host memory, and step time from a timeline simulation of one
training step (compute, collectives, host<->device copies, CPU optimizer) over the profiled
access trace with furthest-next-use chunk eviction and prefetch."""

from elixir_tune.costmodel.cache import belady, simulate_cache
from elixir_tune.costmodel.layout import ChunkLayout, pack_chunks
from elixir_tune.costmodel.memory import MemoryEstimate, estimate_memory, model_state_bytes
from elixir_tune.costmodel.model import CostModel, Shape, StepEstimate

__all__ = [
    "ChunkLayout",
    "CostModel",
    "MemoryEstimate",
    "Shape",
    "StepEstimate",
    "belady",
    "estimate_memory",
    "model_state_bytes",
    "pack_chunks",
    "simulate_cache",
]
