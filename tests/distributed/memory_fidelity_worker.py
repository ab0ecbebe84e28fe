"""Worker for the memory-fidelity test: a real profile and search per case, one warm-up step, then
one measured step (``memory_probe``), and what the plan predicted for it.

Each case: ``model`` (a config name or YAML path), ``fixed`` (search pins; ``cache_blocks: "min"``
is the least the model can run with, plus room for the prefetch), ``micro_batch_size``, ``accum``,
``dtype``, and optionally ``chunk_size`` (default 16384; None leaves it to the search).
Also reported: the engine's gathers and uploads in the measured step against the cost model's
cache simulation of the same trace and plan (cold micro-batch, then steady ones).
"""

from __future__ import annotations

import torch

import elixir_tune
from elixir_tune.costmodel.model import CostModel
from elixir_tune.hardware import load_hardware
from elixir_tune.profiler import load_model_source, profile_model
from elixir_tune.search import search
from tests.distributed.engine_launch import worker_main
from tests.distributed.memory_probe import peak_step_bytes

SEQ = 64
CHUNK_SIZE = 16384
_PROFILES: dict[tuple[str, str], tuple] = {}


def profiled(name: str, dtype: str):
    """The model profiled at the plan's compute dtype, as a user runs ``elixir-tune profile --dtype``."""
    if (name, dtype) not in _PROFILES:
        source = load_model_source(name)
        profile = profile_model(source, batch_size=2, seq_len=SEQ, dtype=dtype, checkpointing="all")
        _PROFILES[name, dtype] = (source, profile)
    return _PROFILES[name, dtype]


def make_plan(case: dict, world: int):
    source, profile = profiled(case["model"], case["dtype"])
    hardware = load_hardware("cpu")
    chunk_size = case.get("chunk_size", CHUNK_SIZE)  # None: the search's own choice
    # Standard accumulation: a layered step runs its forwards on threads that torch.profiler does not
    # follow, so memory_probe cannot see their activations on the CPU.
    fixed = dict(
        case["fixed"],
        micro_batch_size=case["micro_batch_size"],
        dtype=case["dtype"],
        accumulation=case.get("accumulation", "standard"),
    )
    if chunk_size is not None:
        fixed["chunk_size"] = chunk_size
    if fixed.get("cache_blocks") == "min":
        every = {"none": 0, "all": 1}[fixed["checkpointing"]]
        model = CostModel(profile, hardware, gpus_per_node=world, dtype=case["dtype"])
        fixed["cache_blocks"] = model.min_cache_blocks(chunk_size, every) + fixed.get("prefetch", 0)
    global_batch = case["micro_batch_size"] * case["accum"] * world
    fixed = {**fixed, "pipeline": 1, "tensor": 1}  # the chunk engine's data-parallel path
    result = search(profile, hardware, gpus_per_node=world, global_batch_size=global_batch, fixed=fixed)
    return source, profile, result


def simulated_counts(profile, plan, world: int) -> dict[str, int]:
    """Gathers and uploads of one step of non-resident chunks, by the cost model's cache simulation."""
    model = CostModel(profile, load_hardware("cpu"), gpus_per_node=world, dtype=plan.training.dtype)
    every = plan.training.activation_checkpointing.every
    accum = plan.training.grad_accum_steps
    if plan.training.accumulation == "layered":  # one pass for all micro-batches (recomputing each)
        sim, _ = model.cache_sim(plan.memory.chunk_size, every, plan.memory.cache_blocks, accum if every else 1)
        fetches = sim.cold
    else:
        sim, _ = model.cache_sim(plan.memory.chunk_size, every, plan.memory.cache_blocks)
        fetches = sim.cold + sim.steady * (accum - 1)
    offloaded = {chunk.id for chunk in plan.memory.chunks if chunk.offload}
    return {"gathers": len(fetches), "uploads": sum(1 for _, chunk, _ in fetches if chunk in offloaded)}


def set_up(source, plan):
    """The model (seed 0) and AdamW set up for ``plan``, and one micro-batch of its shape."""
    torch.manual_seed(0)
    model = source.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
    return model, optimizer, source.example_batch(plan.training.micro_batch_size, plan.training.seq_len)


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    source, profile, result = make_plan(case, world)
    plan = result.plan
    model, optimizer, batch = set_up(source, plan)
    engine = model.engine

    def step() -> None:
        # Standard or layered accumulation, as the plan says.
        model.forward_backward([batch] * plan.training.grad_accum_steps)
        optimizer.clip_grad_norm(1.0)
        optimizer.step()
        optimizer.zero_grad()

    counts: list[dict] = []

    def measured_step() -> None:
        counts.append(engine.memory_stats())
        step()
        counts.append(engine.memory_stats())

    # The first step records the access order; the measured one is a steady step.
    measured = peak_step_bytes(measured_step, engine.device, warmup=step)
    before, after = counts
    memory = result.candidates[0].memory
    out = {
        "case": case,
        "measured": measured,
        "predicted_gpu_bytes": memory.peak_gpu_bytes,
        "predicted_host_bytes_per_rank": memory.peak_host_bytes // world,
        # For reading a failure: the engine's own count, and the predicted parts of the step.
        "report_bytes": sum(engine.memory_report().values()),
        "predicted_activation_bytes": memory.activation_bytes,
        "predicted_buffer_bytes": memory.buffer_bytes,
        "plan": {
            "cache_blocks": plan.memory.cache_blocks,
            "prefetch": plan.memory.prefetch,
            "offloaded": sum(c.offload for c in plan.memory.chunks),
            "chunks": len(plan.memory.chunks),
            "every": plan.training.activation_checkpointing.every,
            "accum": plan.training.grad_accum_steps,
            "accumulation": plan.training.accumulation,
        },
        "engine_counts": {key: after[key] - before[key] for key in ("gathers", "uploads")},
        "simulated_counts": simulated_counts(profile, plan, world),
    }
    return out


if __name__ == "__main__":
    worker_main(run_case)
