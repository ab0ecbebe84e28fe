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

import torch

import elixir_tune
from tests.distributed.engine_pipeline_families_worker import plain_micro_training
from tests.distributed.engine_plans import make_plan, param_groups
from tests.distributed.engine_worker import compare, mean_over_ranks, plain_training

SEQ = 8
MICRO = 2
ACCUM = 4
BLOCKS = 3
LENGTHS = (7, 5, 7, 6)  # the padded cases' micro-batch lengths


def build(family: str):
    """The family's tiny model and its AdamW (seeded: every rank and the reference build the same weights)."""
    from tests.unit.models import stage_families

    torch.manual_seed(0)
    model = stage_families.build(family, BLOCKS)
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    return model, opt


def global_batches(steps: int, data: int, padded: bool) -> list[list[list[dict]]]:
    """Each step's micro-batches of each data rank: ``[step][data_rank][micro]`` (the same in every process).
    Padded: lengths ``LENGTHS``, the second sample of each micro-batch padded over its last 2 tokens."""
    from tests.unit.models.stage_families import VOCAB

    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        per_rank = []
        for _ in range(data):
            micro = []
            for k in range(ACCUM):
                ids = torch.randint(5, VOCAB, (MICRO, LENGTHS[k] if padded else SEQ), generator=generator)
                batch = {"input_ids": ids, "labels": ids.clone()}
                if padded:
                    batch["attention_mask"] = torch.ones_like(ids)
                    batch["attention_mask"][1, -2:] = 0
                    batch["labels"][1, -2:] = -100
                micro.append(batch)
            per_rank.append(micro)
        out.append(per_rank)
    return out


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    from elixir_tune.profiler.source import quiet_transformers
    from elixir_tune.stage_plans import resolve_stage_plan

    stages, tensor = case["stages"], case["tensor"]
    data = world // (stages * tensor)
    with quiet_transformers():
        model, opt = build(case["family"])
        stage_plan = resolve_stage_plan(model)
        assert not isinstance(stage_plan, str), stage_plan
        plan = make_plan(
            model, world, 4096, block_list=stage_plan.block_list, micro_batch_size=MICRO, grad_accum_steps=ACCUM,
            seq_len=SEQ, stages=stages, tensor=tensor, sequence_parallel=case.get("sequence_parallel", True),
            offload=case.get("offload", 0.0), tensor_mode=case.get("mode", "1d"),
        )  # fmt: skip
        model, opt = elixir_tune.setup(model, opt, plan=plan)
        steps = global_batches(case["steps"], data, case.get("padded", False))
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
    }
    if rank == 0:
        with quiet_transformers():
            reference_model, reference_opt = build(case["family"])
            if case.get("padded"):  # one data rank: its micro-batches one by one, unpadded
                assert data == 1 and not case.get("clip"), "the padded reference runs one data rank, no clipping"
                reference = plain_micro_training(reference_model, reference_opt, [per_rank[0] for per_rank in steps])
            else:
                whole = [
                    {key: torch.cat([b[key] for micro in per_rank for b in micro]) for key in ("input_ids", "labels")}
                    for per_rank in steps
                ]
                reference = plain_training(reference_model, reference_opt, whole, case.get("clip", 0.0))
        engine = {"state": {k: v.tolist() for k, v in state.items()}, "norms": norms}
        result.update(compare(engine, reference, result["world_losses"]))
        result["reference_losses"] = reference["losses"]
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
