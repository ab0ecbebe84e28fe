"""Worker for the pipeline family tests: a tiny causal LM of each family that runs on pipeline stages
(``tests/unit/models/stage_families.py``), 3 blocks on 2 stages (modular: stage 0 runs the embeddings,
block 0 and block 2 with the head; stage 1 block 1 between them), trained through
``model.forward_backward`` and compared with plain PyTorch.

Each case is a dict: ``family``, ``steps``, and ``padded``: the micro-batches then have different
lengths and padding masks (the pipeline pads them at the end to the step's longest and cuts the logits
back before the loss); the reference runs each micro-batch unpadded, its loss over the count, as a
plain accumulation loop does. Without ``padded`` the reference is one forward of the global batch, or
with ``reference``: ``micro`` the same micro-batch loop, ``reversed`` that loop with the backwards in
reverse (the pipeline's order of summing each gradient).

Rank 0 also trains the plain-PyTorch reference (fp32) and reports the largest differences of the
losses and the weights (``model.state_dict()`` merges every stage's weights onto it).
"""

from __future__ import annotations

import torch

import elixir_tune
from tests.distributed.engine_plans import make_plan, param_groups
from tests.distributed.engine_worker import compare, mean_over_ranks, plain_training

SEQ = 8
MICRO = 2
ACCUM = 4
BLOCKS = 3
LENGTHS = (8, 5, 8, 6)  # the padded cases' micro-batch lengths


def build(family: str):
    """The family's tiny model and its AdamW (seeded: every rank and the reference build the same weights)."""
    from tests.unit.models import stage_families

    torch.manual_seed(0)
    model = stage_families.build(family, BLOCKS)
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    return model, opt


def step_batches(case: dict) -> list[list[dict]]:
    """Each step's micro-batches (the same in every process). Padded: lengths ``LENGTHS``, and the second
    sample of every micro-batch padded over its last 2 tokens (mask 0, labels -100)."""
    from tests.unit.models.stage_families import VOCAB

    generator = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(case["steps"]):
        micro = []
        for k in range(ACCUM):
            length = LENGTHS[k] if case.get("padded") else SEQ
            ids = torch.randint(5, VOCAB, (MICRO, length), generator=generator)
            batch = {"input_ids": ids, "labels": ids.clone()}
            if case.get("padded"):
                mask = torch.ones_like(ids)
                mask[1, -2:] = 0
                batch["labels"][1, -2:] = -100
                batch["attention_mask"] = mask
            micro.append(batch)
        steps.append(micro)
    return steps


def plain_micro_training(model, opt, steps: list[list[dict]], reverse: bool = False) -> dict:
    """Plain PyTorch, micro-batch by micro-batch (each unpadded), the mean loss over the micro-batches;
    ``reverse``: every forward first, then the backwards from the last micro-batch to the first, the
    order in which the looped breadth-first schedule sums each parameter's gradient."""
    losses = []
    for micro in steps:
        total = 0.0
        micro_losses = []
        for batch in micro:
            loss = model(**batch).loss / len(micro)
            if not reverse:
                loss.backward()
            micro_losses.append(loss)
            total += float(loss.detach())
        for loss in reversed(micro_losses) if reverse else ():
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": [], "state": {k: v.tolist() for k, v in model.state_dict().items()}}


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    from elixir_tune.profiler.source import quiet_transformers
    from elixir_tune.stage_plans import resolve_stage_plan

    with quiet_transformers():
        model, opt = build(case["family"])
        stage_plan = resolve_stage_plan(model)
        assert not isinstance(stage_plan, str), stage_plan
        chunk_size = max(4096, max(p.numel() for p in model.parameters()))  # the fused experts' tensors
        plan = make_plan(
            model, world, chunk_size, block_list=stage_plan.block_list, micro_batch_size=MICRO, grad_accum_steps=ACCUM,
            seq_len=SEQ, stages=2,
        )  # fmt: skip
        model, opt = elixir_tune.setup(model, opt, plan=plan)
        steps = step_batches(case)
        losses = []
        for micro in steps:
            loss = model.forward_backward(micro)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        state = model.state_dict()
    mesh = model.engine.mesh
    result = {
        "case": case,
        "stage": mesh.stage,
        "source": stage_plan.source,
        "virtual": [blocks for stage, blocks in model.engine.pipeline.layout.virtual if stage == mesh.stage],
        "losses": losses,
        "world_losses": mean_over_ranks(losses, world),
    }
    if rank == 0:
        with quiet_transformers():
            reference_model, reference_opt = build(case["family"])
            if case.get("padded") or case.get("reference") in ("micro", "reversed"):
                reverse = case.get("reference") == "reversed"
                reference = plain_micro_training(reference_model, reference_opt, steps, reverse)
            else:
                whole = [{key: torch.cat([b[key] for b in micro]) for key in micro[0]} for micro in steps]
                reference = plain_training(reference_model, reference_opt, whole)
        engine = {"state": {k: v.tolist() for k, v in state.items()}, "norms": []}
        result.update(compare(engine, reference, result["world_losses"]))
        result["reference_losses"] = reference["losses"]
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
