"""Worker for the engine's run checks (world 2, gloo): the data contract at the first step, and the
stop on a non-finite fp32/bf16 step, with tensor, pipeline and data-parallel plans of the tiny GPT-2.

Run by ``engine_launch.py``; each case is a dict:

    check: contract | nonfinite      layout: data | tensor | pipeline (degree 2 each)
    contract: slice: rank (each rank slices the global batch by RANK, the mistake) | data (by its
        data-parallel index, the contract); trained 2 steps, rank 0 compares with plain PyTorch
    nonfinite: lr (AdamW), nan_rank and nan_step (that rank's last micro-batch of that step has all
        its labels ignored: a NaN loss), dtype

Each rank reports the error it got (type and message) and, for nonfinite, whether its weights are
finite and equal to those before the failing step.
"""

from __future__ import annotations

import torch

import elixir_tune
from tests.distributed.engine_plans import batches, make_plan, param_groups, tiny_gpt2
from tests.distributed.engine_worker import compare, local_micro, mean_over_ranks, plain_training

SEQ = 8
MICRO = 2
ACCUM = 2
STEPS = 2


def build(case: dict, world: int):
    model = tiny_gpt2()
    opt = torch.optim.AdamW(param_groups(model), lr=case.get("lr", 3e-3), betas=(0.9, 0.95), eps=1e-6)
    layout = case["layout"]
    plan = make_plan(
        model,
        world,
        4096,
        block_list="transformer.h",
        micro_batch_size=MICRO,
        grad_accum_steps=ACCUM,
        seq_len=SEQ,
        stages=2 if layout == "pipeline" else 1,
        tensor=2 if layout == "tensor" else 1,
        dtype=case.get("dtype", "fp32"),
    )
    return model, opt, plan


def my_micro_batches(case: dict, batch: dict, rank: int, world: int, data_rank: int, data: int) -> list[dict]:
    """``slice: rank``: rows rank x (micro x accum) onwards, as a script slicing by RANK does (rank 1 of a
    tensor or pipeline pair gets an empty batch); otherwise the data index's micro-batches."""
    if case.get("slice") == "rank":
        per_rank = MICRO * ACCUM
        return [
            {k: v[begin : begin + MICRO] for k, v in batch.items()}
            for begin in range(rank * per_rank, (rank + 1) * per_rank, MICRO)
        ]
    return [local_micro(batch, data_rank, data, ACCUM, k) for k in range(ACCUM)]


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    from elixir_tune.profiler.source import quiet_transformers

    with quiet_transformers():
        model, opt, plan = build(case, world)
        model, opt = elixir_tune.setup(model, opt, plan=plan)
    mesh = model.engine.mesh
    data = plan.data_parallel_size
    global_batches = batches(STEPS if case["check"] == "contract" else 8, plan.training.global_batch_size, SEQ)
    losses: list[float] = []
    error = None
    before: list[torch.Tensor] = []
    for step, batch in enumerate(global_batches):
        micro_batches = my_micro_batches(case, batch, rank, world, mesh.data_rank, data)
        if step == case.get("nan_step") and rank == case.get("nan_rank"):
            micro_batches[-1]["labels"] = torch.full_like(micro_batches[-1]["labels"], -100)
        before = [chunk.master.detach().clone() for chunk in model.engine.chunks]
        try:
            losses.append(float(model.forward_backward(micro_batches)))
            opt.step()
            opt.zero_grad()
        except (elixir_tune.ContractError, elixir_tune.NonFiniteError) as caught:
            error = {"type": type(caught).__name__, "message": str(caught), "step": step + 1}
            break
    after = [chunk.master.detach() for chunk in model.engine.chunks]
    result = {
        "case": case,
        "error": error,
        "losses": losses,
        "finite": all(bool(torch.isfinite(m).all()) for m in after),
        "unchanged": all(torch.equal(a, b) for a, b in zip(after, before, strict=True)),
    }
    if case["check"] == "contract" and error is None:
        state = model.state_dict()
        result["world_losses"] = mean_over_ranks(losses, world)
        if rank == 0:
            with quiet_transformers():
                reference_model = tiny_gpt2()
                reference_opt = torch.optim.AdamW(param_groups(reference_model), lr=3e-3, betas=(0.9, 0.95), eps=1e-6)
                reference = plain_training(reference_model, reference_opt, global_batches)
            engine = {"state": {k: v.tolist() for k, v in state.items()}, "norms": []}
            result.update(compare(engine, reference, result["world_losses"]))
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
