"""Worker for test_plan_memory_layouts.py: a plan the test searched (and saved) for a tiny causal LM,
set up on this rank; what the engine reports it holds (``memory_report``) before and after one
training step, and the gradients the step really held (``memory_stats``).

Each case: ``model`` (the model YAML the plan was searched for), ``plan`` (the plan file), ``lora``
(optional ``apply_lora`` arguments, as the profile was made with), ``measure`` (optional: the step's
real peak, ``memory_probe``, after a warm-up step).
"""

from __future__ import annotations

import torch

import elixir_tune
from tests.distributed.engine_launch import worker_main
from tests.distributed.memory_probe import peak_step_bytes


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    from elixir_tune.models.lora import apply_lora
    from elixir_tune.plan import load_plan
    from elixir_tune.profiler import load_model_source
    from elixir_tune.profiler.source import quiet_transformers

    plan = load_plan(case["plan"])
    with quiet_transformers():
        source = load_model_source(case["model"])
        torch.manual_seed(0)
        model = source.build_model()
        if case.get("lora"):
            model = apply_lora(model, **case["lora"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
        before = model.memory_report()
        batch = source.example_batch(plan.training.micro_batch_size, plan.training.seq_len)

        def train_step() -> None:
            model.forward_backward([batch] * plan.training.grad_accum_steps)
            optimizer.step()
            optimizer.zero_grad()

        measured = peak_step_bytes(train_step, torch.device("cpu"), train_step) if case.get("measure") else None
        if measured is None:
            train_step()
    mesh = model.engine.mesh
    return {
        "case": case,
        "stage": mesh.stage,
        "tensor_rank": mesh.tensor_rank,
        "data_rank": mesh.data_rank,
        "report_before": before,
        "report_after": model.memory_report(),
        "peak_held_grad_bytes": model.engine.memory_stats()["peak_held_grad_bytes"],
        "measured": measured,
    }


if __name__ == "__main__":
    worker_main(run_case)
