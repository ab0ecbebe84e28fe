"""Worker for the test that runs plans the search emits with expert parallelism: the engine under
such a plan against plain PyTorch.

Run by ``engine_launch.py`` as N processes (gloo, CPU). Each case is a dict:

    model: zoo:NAME (a mixture-of-experts zoo model, tests/zoo/models.py)
    plan: the plan file the search wrote (its expert degree, chunks, micro-batches)
    micro, accum: the plan's micro-batch size and micro-batches per step      steps
    loop: plain (``model(**batch)`` and ``optimizer.backward`` per micro-batch) or forward_backward

The model and data are those of ``engine_ep_worker.py`` (routers skewed so that the ranks exchange
unequal numbers of rows); rank 0 also trains plain PyTorch on each whole global batch and reports the
largest differences, and plain PyTorch accumulated over the engine's micro-batches (the control: plain
PyTorch's own fp32 floor).
"""

from __future__ import annotations

import elixir_tune
from tests.distributed.engine_ep_worker import build, global_batches, run_reference, step_loss
from tests.distributed.engine_worker import compare, local_micro, mean_over_ranks, plain_accumulated_training


def run_engine(case: dict, rank: int, world: int) -> dict:
    model, opt = build(case, world)
    model, opt = elixir_tune.setup(model, opt, plan=case["plan"])
    engine = model.engine
    offloaded_expert_chunks = sum(1 for c in engine.chunks if c.offload and c.grad_divisor is not None)
    accum = case["accum"]
    local_experts = {
        name: p.shape[0] for name, p in model.module.named_parameters() if name.endswith(("gate_up_proj", "down_proj"))
    }
    losses = []
    for batch in global_batches(case, world):
        micro = [local_micro(batch, rank, world, accum, k) for k in range(accum)]
        losses.append(step_loss(model, opt, micro, case["loop"]))
        opt.step()
        opt.zero_grad()
    full = model.state_dict()  # a collective: every rank calls it
    return {
        "memory_report": engine.memory_report(),  # after the steps: the optimizer state is allocated
        "offloaded_expert_chunks": offloaded_expert_chunks,
        "losses": losses,
        "norms": [],
        "state": {k: v.tolist() for k, v in full.items()} if rank == 0 else None,
        "local_experts": local_experts,
    }


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    engine = run_engine(case, rank, world)
    world_losses = mean_over_ranks(engine["losses"], world)
    result = {"case": case, "world_losses": world_losses}
    result.update({key: engine[key] for key in ("local_experts", "memory_report", "offloaded_expert_chunks")})
    if rank == 0:
        reference = run_reference(case, world)
        result.update(compare(engine, reference, world_losses))
        # Plain PyTorch against itself: each global batch as the world x accum micro-batches the engine's
        # ranks run (loss / (world x accum), gradients accumulated), the same mathematics in the engine's
        # summation order. How far its weights drift from the reference is plain PyTorch's own fp32 floor
        # for this model and machine (a top-k router turns a last-bit difference into another expert).
        model, opt = build(case, world)
        control = plain_accumulated_training(model, opt, global_batches(case, world), world * case["accum"])
        result["control_weight_abs"] = compare(control, reference, control["losses"])["weight_abs"]
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
