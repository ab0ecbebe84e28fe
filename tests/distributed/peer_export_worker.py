"""Worker for the export tests: what ``elixir-tune export`` wrote, run the engine's own way.

Run by ``engine_launch.py`` (gloo, CPU). Each case is a dict:

    target: fsdp2 (the exported file's ``apply_plan(model)``, then a plain loop)
        | deepspeed (``deepspeed.initialize`` with the exported ds_config.json, then DeepSpeed's own
        loop: ``engine.backward(loss)`` and ``engine.step()`` per micro-batch)
    plan: the path of the plan file the test exported from    exported: the path of the exported file
"""

from __future__ import annotations

import importlib.util
import json

import torch

from tests.distributed.engine_worker import compare, local_micro, mean_over_ranks, plain_training
from tests.zoo.models import build, global_batches

STEPS = 3


def build_pair():
    model = build("gpt2")
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)


def run_fsdp2(case: dict, batches: list[dict], rank: int, world: int, accum: int):
    import torch.distributed as dist

    if not dist.is_initialized():  # as a torchrun script starts it before calling apply_plan
        dist.init_process_group("gloo")
    spec = importlib.util.spec_from_file_location("fsdp2_setup", case["exported"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.apply_plan(build("gpt2"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    losses = []
    for batch in batches:
        total = 0.0
        for k in range(accum):
            loss = model(**local_micro(batch, rank, world, accum, k)).loss / accum
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return losses, state


def run_deepspeed(case: dict, batches: list[dict], rank: int, world: int, accum: int):
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    model, opt = build_pair()
    config = json.loads(open(case["exported"]).read())
    if "offload_optimizer" in config["zero_optimization"]:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    losses = []
    for batch in batches:
        total = 0.0
        for k in range(accum):
            loss = engine(**local_micro(batch, rank, world, accum, k)).loss
            engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps
            engine.step()  # an update at the accumulation boundary only
            total += float(loss.detach()) / accum
        losses.append(total)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    from elixir_tune.plan import load_plan

    plan = load_plan(case["plan"])
    accum = plan.training.grad_accum_steps
    batches = global_batches("gpt2", STEPS, plan.training.micro_batch_size * accum * world)
    run = run_fsdp2 if case["target"] == "fsdp2" else run_deepspeed
    losses, state = run(case, batches, rank, world, accum)
    world_losses = mean_over_ranks(losses, world)
    result = {"case": case, "world_losses": world_losses}
    if rank == 0:
        reference = plain_training(*build_pair(), batches)
        engine = {"state": {k: v.tolist() for k, v in state.items()}, "norms": []}
        result.update(compare(engine, reference, world_losses))
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
