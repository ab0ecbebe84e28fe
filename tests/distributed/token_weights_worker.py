"""Worker for the token-weighted accumulation test: a batch whose masks leave every micro-batch a
different count of loss tokens, trained through ``model.forward_backward`` (and a plain loop with
``model.token_weights``) on a data, a pipeline and a tensor plan, against plain PyTorch on the whole
global batch at once.

Run by ``engine_launch.py`` on 2 ranks (gloo, CPU). Each case is a dict:

    shape: data (2 data ranks) | pipeline (2 stages) | tensor (degree 2)
    accumulation: standard | layered         loop: forward_backward | plain (model.token_weights)

Rank 0 also trains the reference and reports the largest differences of the step losses (the mean of
the ranks' returned shares) and of the weights.
"""

from __future__ import annotations

import torch

import elixir_tune
from tests.distributed.engine_plans import batches, make_plan, param_groups, tiny_gpt2
from tests.distributed.engine_worker import compare, local_micro, mean_over_ranks, plain_training

SEQ = 8
MICRO = 2
ACCUM = 3
STEPS = 3
BLOCK_LIST = "transformer.h"


def masked_batches(global_batch: int) -> list[dict]:
    """Deterministic batches whose rows keep 1 to SEQ - 1 loss tokens (a masked prompt of random
    length, -100 before it), so micro-batches and data ranks count different tokens."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for batch in batches(STEPS, global_batch, SEQ):
        labels = batch["labels"].clone()
        prompt = torch.randint(1, SEQ - 1, (global_batch,), generator=generator)
        labels[torch.arange(SEQ)[None, :] <= prompt[:, None]] = -100
        out.append({"input_ids": batch["input_ids"], "labels": labels})
    return out


def build():
    model = tiny_gpt2()
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    return model, opt


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    stages = world if case["shape"] == "pipeline" else 1
    tensor = world if case["shape"] == "tensor" else 1
    model, opt = build()
    plan = make_plan(
        model,
        world,
        4096,
        block_list=BLOCK_LIST,
        micro_batch_size=MICRO,
        grad_accum_steps=ACCUM,
        seq_len=SEQ,
        stages=stages,
        tensor=tensor,
    )
    plan.training.accumulation = case.get("accumulation", "standard")
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    data, data_rank = elixir_tune.data_size(), elixir_tune.data_rank()
    global_batches = masked_batches(plan.training.global_batch_size)
    losses, counts = [], []
    for batch in global_batches:
        micro = [local_micro(batch, data_rank, data, ACCUM, k) for k in range(ACCUM)]
        counts.append([int((m["labels"][:, 1:] != -100).sum()) for m in micro])
        if case.get("loop") == "plain":
            share = 0.0
            for weight, micro_batch in zip(model.token_weights(micro), micro, strict=True):
                loss = model(**micro_batch).loss * weight
                opt.backward(loss)
                share += float(loss.detach())
        else:
            share = float(model.forward_backward(micro))
        opt.step()
        opt.zero_grad()
        losses.append(share)
    state = model.state_dict()
    # The shares' mean over the ranks: a tensor or pipeline group's ranks return the same share.
    result = {"case": case, "counts": counts, "world_losses": mean_over_ranks(losses, world)}
    if rank == 0:
        reference_model, reference_opt = build()
        with torch.no_grad():  # the control: the plain mean of every micro-batch's mean loss, first step
            first = global_batches[0]
            means = [
                reference_model(**local_micro(first, r, data, ACCUM, k)).loss for r in range(data) for k in range(ACCUM)
            ]
            result["unweighted_rel"] = abs(float(torch.stack(means).mean() / reference_model(**first).loss) - 1)
        reference = plain_training(reference_model, reference_opt, global_batches)
        engine = {"state": {k: v.tolist() for k, v in state.items()}, "norms": []}
        result.update(compare(engine, reference, result["world_losses"]))
        result["ref_losses"] = reference["losses"]
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
