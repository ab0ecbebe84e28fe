"""Worker for the context-parallel memory test: a Llama whose activations at 4096 tokens do not fit
a device-memory budget with any plan of world 2 without context parallelism. The search (no pins)
must pick context 2; the plan then runs one warm-up and one measured step (``memory_probe``), and
rank 0 reports the measured peak beside the plan's promise.

Each case: ``budget_mib`` (the search's ``device_memory_bytes``; None: the machine's), ``seq`` (tokens
per sample), ``fixed`` (search pins: ``["context=1"]`` is the data-parallel control).
"""

from __future__ import annotations

from pathlib import Path

from elixir_tune.hardware import load_hardware
from elixir_tune.profiler import load_model_source, profile_model
from elixir_tune.search import search
from tests.distributed.engine_launch import worker_main
from tests.distributed.memory_fidelity_worker import set_up
from tests.distributed.memory_probe import peak_step_bytes

MODEL = str(Path(__file__).with_name("llama_long.yaml"))


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    source = load_model_source(MODEL)
    profile = profile_model(source, batch_size=1, seq_len=case["seq"], dtype="fp32", checkpointing="all")
    budget = int(case["budget_mib"] * 2**20) if case.get("budget_mib") else None
    result = search(
        profile,
        load_hardware("cpu"),
        gpus_per_node=world,
        global_batch_size=world,
        device_memory_bytes=budget,
        fixed=case.get("fixed"),
    )
    plan = result.plan
    model, optimizer, batch = set_up(source, plan)

    def step() -> None:
        model.forward_backward([batch] * plan.training.grad_accum_steps)
        optimizer.step()
        optimizer.zero_grad()

    memory = result.candidates[0].memory
    return {
        "case": case,
        "context": plan.parallel.context.degree,
        "why": result.why,
        "measured": peak_step_bytes(step, model.engine.device, warmup=step),
        # On a CPU plan device and host are one pool: the device peak plus this rank's share of the host's.
        "predicted_bytes": memory.peak_gpu_bytes + memory.peak_host_bytes // world,
        "required_bytes": memory.required_gpu_bytes,
        "budget_bytes": budget,
    }


if __name__ == "__main__":
    worker_main(run_case)
