"""Worker for the peer engines' tests: a zoo model trained through ``elixir_tune.setup`` on a plan
that names FSDP2 or DeepSpeed, compared with plain PyTorch on the same global batches.

Run by ``engine_launch.py`` (gloo, CPU). Each case is a dict:

    family: a zoo model (tests/zoo/models.py)    engine: fsdp2 | deepspeed
    settings: the plan's engine section beyond its name (offload_params, offload_units, zero_stage, ...)
    loop: plain (``model(**batch)``, then ``loss.backward()``) | optimizer (``optimizer.backward(loss)``)
        | forward_backward (``model.forward_backward(micro_batches)``)
    accum: micro-batches per step    checkpoint: every k-th block recomputed    clip: max gradient norm
    reload: load zeros, then the trained weights, through model.load_state_dict
    torch_clip: clip with torch.nn.utils.clip_grad_norm_(model.parameters()) instead of optimizer.clip_grad_norm
"""

from __future__ import annotations

import torch

import elixir_tune
from elixir_tune.plan import validate
from elixir_tune.plan.engine_choice import EngineChoice
from tests.distributed.engine_plans import make_plan
from tests.distributed.engine_worker import compare, local_micro, mean_over_ranks, plain_training
from tests.zoo.models import SEQ, build, global_batches

MICRO = 2
STEPS = 3
BLOCK_LISTS = {"gpt2": "transformer.h"}


def build_pair(case: dict):
    model = build(case["family"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    return model, opt


def peer_plan(model, case: dict, world: int):
    plan = make_plan(
        model,
        world,
        8192,  # the MoE's fused experts hold 8192 elements
        block_list=BLOCK_LISTS.get(case["family"], "model.layers"),
        micro_batch_size=MICRO,
        grad_accum_steps=case.get("accum", 1),
        seq_len=SEQ,
        checkpoint_every=case.get("checkpoint", 0),
    )
    plan.engine = EngineChoice(name=case["engine"], **case.get("settings", {}))
    problems = validate(plan)
    assert not problems, problems
    return plan


def train(model, opt, case: dict, batches: list[dict], rank: int, world: int) -> tuple[list[float], list[float]]:
    """This rank's loss of each step and the clipped norms, through the loop the case names."""
    accum, loop = case.get("accum", 1), case.get("loop", "plain")
    losses, norms = [], []
    for batch in batches:
        micro = [local_micro(batch, rank, world, accum, k) for k in range(accum)]
        if loop == "forward_backward":
            total = float(model.forward_backward(micro))
        else:
            total = 0.0
            for piece in micro:
                loss = model(**piece).loss / accum
                loss.backward() if loop == "plain" else opt.backward(loss)
                total += float(loss.detach())
        if case.get("clip") and case.get("torch_clip"):  # torch's own function, as a DDP script calls it
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])))
        elif case.get("clip"):
            norms.append(float(opt.clip_grad_norm(case["clip"])))
        if case.get("grad_norm"):
            opt.grad_norm()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms


def fsdp2_units(module, plan) -> dict:
    """How many fully_shard units the runner made, how many keep their state on the host (read from
    FSDP2's own unit state), and what the plan asks for."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from elixir_tune.engine.peers.common import plan_blocks
    from elixir_tune.engine.peers.fsdp2 import offloaded_units

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    offloaded = sum(
        any(isinstance(group.offload_policy, CPUOffloadPolicy) for group in unit._get_fsdp_state()._fsdp_param_groups)
        for unit in units
    )
    blocks = len(plan_blocks(module, plan))
    return {
        "units": len(units),
        "blocks": blocks,
        "offloaded_units": offloaded,
        "expected_offloaded_units": offloaded_units(plan, blocks + 1),
    }


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    """One case on this rank; rank 0 also trains plain PyTorch and compares."""
    model, opt = build_pair(case)
    plan = peer_plan(model, case, world)
    batches = global_batches(case["family"], STEPS, MICRO * case.get("accum", 1) * world)
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    losses, norms = train(model, opt, case, batches, rank, world)
    reload_ok = None
    if case.get("reload"):  # load_state_dict reaches the shards: zeros in, the trained weights back
        full = model.state_dict(all_ranks=True)
        model.load_state_dict({name: torch.zeros_like(value) for name, value in full.items()})
        reload_ok = all(float(value.abs().max()) == 0 for value in model.state_dict(all_ranks=True).values())
        model.load_state_dict(full)
    state = model.state_dict()  # a collective: rank 0 gets the full weights
    world_losses = mean_over_ranks(losses, world)
    result = {"case": case, "world_losses": world_losses, "reload_ok": reload_ok}
    if case["engine"] == "fsdp2":
        result.update(fsdp2_units(model.module, plan))
    if rank == 0:
        reference_model, reference_opt = build_pair(case)
        reference = plain_training(reference_model, reference_opt, batches, clip=case.get("clip", 0.0))
        engine = {"state": {k: v.tolist() for k, v in state.items()}, "norms": norms}
        result.update(compare(engine, reference, world_losses))
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
