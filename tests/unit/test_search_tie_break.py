"""The search's order among plans the plausibility bound raised to the same step (issue 23).

Plans clamped to a bound tie on their predicted step; they are ordered by the simulated (unclamped)
step, then by fewer offloaded shards, then by less memory, so the plan listed first does not carry
offload that only the bound hides.
"""

from __future__ import annotations

from elixir_tune.costmodel.memory import MemoryEstimate
from elixir_tune.costmodel.model import Shape, StepEstimate
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.search import search
from elixir_tune.search.candidate import Candidate
from elixir_tune.search.joint import _TopK

GIB = 2**30


def _candidate(step_s: float, clamp_s: float, offloaded: int, gpu_gib: float, host_gib: float = 0.0) -> Candidate:
    memory = MemoryEstimate(
        model_state_bytes={},
        frozen_bytes=0,
        activation_bytes=0,
        buffer_bytes=0,
        margin_bytes=0,
        peak_gpu_bytes=int(gpu_gib * GIB),
        peak_host_bytes=int(host_gib * GIB),
    )
    breakdown = {"bound_compute_s": step_s} | ({"bound_clamp_s": clamp_s} if clamp_s else {})
    return Candidate(
        shape=Shape(1 << 20, 2, offloaded, 1, 0, 1, 8),
        num_chunks=16,
        num_cacheable=16,
        dtype="bf16",
        memory=memory,
        estimate=StepEstimate(step_time_s=step_s, breakdown=breakdown),
        tokens_per_s=1.0 / step_s,
        tflops_per_gpu=1.0,
        mfu=0.5,
    )


def test_clamped_ties_rank_by_simulated_step_then_offload_then_memory():
    top = _TopK(10)
    # simulated 8.0 s, the least device memory (its shards on the host)
    heavy_offload = _candidate(10.0, 2.0, offloaded=12, gpu_gib=20, host_gib=30)
    no_offload = _candidate(10.0, 2.0, offloaded=0, gpu_gib=40)  # simulated 8.0 s
    slower_sim = _candidate(10.0, 0.5, offloaded=0, gpu_gib=30, host_gib=1)  # simulated 9.5 s
    unclamped = _candidate(11.0, 0.0, offloaded=0, gpu_gib=10)
    for candidate in (heavy_offload, slower_sim, unclamped, no_offload):
        top.add(candidate)
    # Before the tie-break the least device memory (the most offload) came first among the clamped.
    assert top.ranked() == [no_offload, heavy_offload, slower_sim, unclamped]
    assert [c.unclamped_step_s for c in top.ranked()] == [8.0, 8.0, 9.5, 11.0]


def test_a_clamped_plan_with_a_slower_simulation_and_no_less_memory_is_dominated():
    top = _TopK(10)
    best = _candidate(10.0, 2.0, offloaded=0, gpu_gib=20)
    top.add(best)
    top.add(_candidate(10.0, 1.0, offloaded=0, gpu_gib=25))  # same prediction, slower simulation, more memory
    assert top.ranked() == [best]


def test_search_lists_the_clamped_plan_with_the_fastest_simulation_first():
    # A 7B GPT on one A100 node with 512 samples per step: the bound (compute at the best published
    # MFU) binds the fastest plans, and one with offloaded shards predicts the same clamped step.
    profile = gpt2_profile(
        "gpt-7b",
        hidden=4096,
        layers=32,
        heads=32,
        vocab=50304,
        positions=2048,
        seq_len=2048,
        dtype="bf16",
        flash_attention=True,
    )
    result = search(
        profile,
        load_hardware("a100-80gb-sxm"),
        gpus_per_node=8,
        nodes=1,
        global_batch_size=512,
        fixed={"dtype": "bf16", "tensor": 1, "pipeline": 1, "checkpointing": "every:2", "micro_batch_size": 1},
        loop="forward_backward",
        top_k=20,
    )
    best = result.candidates[0]
    assert best.estimate.breakdown.get("bound_clamp_s", 0.0) > 0, "the case needs a plan clamped to the bound"
    tied = [c for c in result.candidates if c.step_time_s == best.step_time_s]
    assert any(c.shape.num_offloaded > best.shape.num_offloaded for c in tied[1:]), "the case needs a tie"
    assert best.unclamped_step_s == min(c.unclamped_step_s for c in tied)
    keys = [c.rank_key() for c in result.candidates]
    assert keys == sorted(keys)
    assert best.shape.num_offloaded == 0
