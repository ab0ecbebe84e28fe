"""Worker for test_engine_mesh3d.py: pipeline x tensor (x data) in one mesh against plain PyTorch.

Each case is a dict: ``family`` (tests/unit/models/stage_families.py), ``stages``, ``tensor``, ``steps``,
``clip`` (max gradient norm, 0: none), ``sequence_parallel``, ``mode`` (tensor 1d or 2d), ``offload`` (share of chunks offloaded), ``padded`` (micro-batches of lengths 7, 5, 7, 6
with padding masks: the pipeline pads them to 8, the step's longest rounded up to a multiple of the tensor
degree, and the reference runs each unpadded, its loss over the count). The world is data x stages x tensor; each
data rank reads its own micro-batches (``elixir_tune.data_rank()``), every rank of one pipeline and tensor
group the same ones. Rank 0 also trains the plain-PyTorch reference on each step's global batch (fp32) and
reports the largest differences of the losses, the clipped norms and the weights (``model.state_dict()``
merges every stage's and tensor rank's pieces onto it).
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

LENGTHS = (7, 5, 7, 6)  # the padded cases' micro-batch lengths


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    from elixir_tune.models.stage_plans import resolve_stage_plan
    from elixir_tune.profiler.source import quiet_transformers

    stages, tensor = case["stages"], case["tensor"]
    data = world // (stages * tensor)
    with quiet_transformers():
        model, opt = build_stage_family(case["family"])
        stage_plan = resolve_stage_plan(model)
        assert not isinstance(stage_plan, str), stage_plan
        plan = make_plan(
            model, world, 4096, block_list=stage_plan.block_list, micro_batch_size=MICRO, grad_accum_steps=ACCUM,
            seq_len=SEQ, stages=stages, tensor=tensor, sequence_parallel=case.get("sequence_parallel", True),
            offload=case.get("offload", 0.0), tensor_mode=case.get("mode", "1d"),
        )  # fmt: skip
        model, opt = elixir_tune.setup(model, opt, plan=plan)
        steps = stage_family_batches(case["steps"], data, LENGTHS if case.get("padded") else None)
        losses, norms = [], []
        for per_rank in steps:
            loss = model.forward_backward(per_rank[elixir_tune.data_rank()])
            if case.get("clip"):
                norms.append(float(opt.clip_grad_norm(case["clip"])))
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        state = model.state_dict()
    mesh = model.engine.mesh
    result = {
        "case": case,
        "coords": [mesh.data_rank, mesh.stage, mesh.tensor_rank],
        "data": [elixir_tune.data_rank(), elixir_tune.data_size()],
        "groups": {name: getattr(mesh, name).global_ranks for name in ("data", "pipeline", "tensor")},
        "losses": losses,
        "norms": norms,
        "world_losses": mean_over_ranks(losses, world),
        # No-sync's held gradients: the engine's report (its plan promise) and what the steps held.
        "held": [model.memory_report()["held_grad_bytes"], model.engine.memory_stats()["peak_held_grad_bytes"]],
    }
    if rank == 0:
        with quiet_transformers():  # padded: one data rank's micro-batches one by one, unpadded
            mode = "micro" if case.get("padded") else "whole"
            reference = stage_family_reference(case["family"], steps, mode, case.get("clip", 0.0))
        result.update(compare_with_reference(state, norms, reference, result["world_losses"]))
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
