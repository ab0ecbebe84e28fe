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

import elixir_tune
from tests.distributed.engine_plans import make_plan
from tests.distributed.engine_worker import mean_over_ranks
from tests.distributed.torch_reference import (
    ACCUM,
    MICRO,
    SEQ,
    build_stage_family,
    compare_with_reference,
    stage_family_batches,
    stage_family_reference,
)

LENGTHS = (8, 5, 8, 6)  # the padded cases' micro-batch lengths


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    from elixir_tune.models.stage_plans import resolve_stage_plan
    from elixir_tune.profiler.source import quiet_transformers

    with quiet_transformers():
        model, opt = build_stage_family(case["family"])
        stage_plan = resolve_stage_plan(model)
        assert not isinstance(stage_plan, str), stage_plan
        chunk_size = max(4096, max(p.numel() for p in model.parameters()))  # the fused experts' tensors
        plan = make_plan(
            model, world, chunk_size, block_list=stage_plan.block_list, micro_batch_size=MICRO, grad_accum_steps=ACCUM,
            seq_len=SEQ, stages=2,
        )  # fmt: skip
        model, opt = elixir_tune.setup(model, opt, plan=plan)
        steps = stage_family_batches(case["steps"], 1, LENGTHS if case.get("padded") else None)
        losses = []
        for (micro,) in steps:
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
        with quiet_transformers():  # padded: the micro-batches one by one, unpadded
            mode = case.get("reference", "micro" if case.get("padded") else "whole")
            reference = stage_family_reference(case["family"], steps, mode)
        result.update(compare_with_reference(state, [], reference, result["world_losses"]))
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
