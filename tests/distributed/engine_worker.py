"""Worker for the engine's multi-process tests: trains cases with the engine, compares with torch.

Run by ``engine_launch.py`` as N processes with the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); also importable, for world size 1 in-process. Each case is a dict:

    model: gpt2 | tied          optimizer: adamw | adam | sgd
    chunk_size, cache ("all" | "min" | int), offload (fraction), prefetch, checkpoint (every),
    accum (micro-batches per step), micro (samples per micro-batch per rank), steps, dtype,
    clip (max norm or 0), scheduler (bool), resident (chunk ids), plant_inf_step (fp16 test),
    alternate_extra (TiedNet's ``extra`` module runs in every third step only)

Rank 0 also trains plain PyTorch on the whole global batch (fp32; autocast for bf16 cases) and
returns both loss curves and the largest weight difference.
"""

from __future__ import annotations

import time

import torch

import elixir_tune
from elixir_tune.plan import SHARD_BYTES_PER_ELEMENT
from elixir_tune.plan.memory import transient_bytes
from tests.distributed.engine_plans import batches, param_groups, plan_for_case, tied_net, tiny_gpt2

SEQ = 8


def build(case: dict):
    model = tiny_gpt2() if case["model"] == "gpt2" else tied_net()
    groups = param_groups(model)
    name = case.get("optimizer", "adamw")
    if name == "adamw":
        opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    elif name == "adam":
        opt = torch.optim.Adam(groups, lr=3e-3, foreach=False)
    else:
        opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9, foreach=False)
    scheduler = None
    if case.get("scheduler"):
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))
    return model, opt, scheduler


def block_list(case: dict) -> str:
    return "transformer.h" if case["model"] == "gpt2" else "body"


def global_batches(case: dict, world: int):
    return batches(case.get("steps", 20), case.get("micro", 2) * case.get("accum", 1) * world, SEQ)


def local_micro(batch: dict, rank: int, world: int, accum: int, k: int) -> dict:
    """Micro-batch k of this rank: ranks take contiguous slices, micro-batches split those."""
    per_rank = len(next(iter(batch.values()))) // world
    per_micro = per_rank // accum
    start = rank * per_rank + k * per_micro
    return {key: value[start : start + per_micro] for key, value in batch.items()}


def mean_over_ranks(losses: list[float], world: int) -> list[float]:
    """Each step's loss averaged over the ranks (a collective): the global batch's loss."""
    import torch.distributed as dist

    total = torch.tensor(losses, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(total)
    return (total / world).tolist()


def plain_training(model, opt, global_batches: list[dict], clip: float = 0.0) -> dict:
    """Plain PyTorch on each step's whole global batch: the reference the engine must match (``clip``:
    the global gradient norm is clipped to it and recorded)."""
    losses, norms = [], []
    for batch in global_batches:
        loss = model(**batch).loss
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "state": {k: v.tolist() for k, v in model.state_dict().items()}}


def plain_accumulated_training(model, opt, global_batches: list[dict], accum: int, clip: float = 0.0) -> dict:
    """The control for ``plain_training``: the same steps in plain PyTorch with each global batch run
    as ``accum`` micro-batches (loss / accum, gradients accumulated), the same mathematics in another
    fp32 summation order. How far its weights drift from the reference is plain PyTorch's own floor."""
    losses, norms = [], []
    for batch in global_batches:
        total = 0.0
        for k in range(accum):
            loss = model(**local_micro(batch, 0, 1, accum, k)).loss / accum
            loss.backward()
            total += float(loss.detach())
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "state": {k: v.tolist() for k, v in model.state_dict().items()}}


def train_steps(model, opt, global_batches: list[dict], rank: int, world: int, accum: int) -> list[float]:
    """Plain training steps through the engine's API; this rank's loss of each step."""
    losses = []
    for batch in global_batches:
        total = 0.0
        for k in range(accum):
            loss = model(**local_micro(batch, rank, world, accum, k)).loss / accum
            opt.backward(loss)
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def run_engine(case: dict, rank: int, world: int) -> dict:
    model, opt, _ = build(case)
    plan = plan_for_case(model, world, case, block_list(case), SEQ)
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    scheduler = None
    if case.get("scheduler"):
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))
    accum = case.get("accum", 1)
    losses, norms, skipped = [], [], []
    for step, batch in enumerate(global_batches(case, world)):
        total = 0.0
        if case.get("alternate_extra"):
            model.module.use_extra = step % 3 == 1  # a module used in some steps only
        for k in range(accum):
            loss = model(**local_micro(batch, rank, world, accum, k)).loss / accum
            opt.backward(loss)
            total += float(loss.detach())
        if case.get("plant_inf_step") == step and rank == world - 1:
            model.engine.chunks[0].grad[0] = float("inf")  # only this rank's shard sees it
        if case.get("clip"):
            norms.append(float(opt.clip_grad_norm(case["clip"])))
        before = opt.skipped_steps
        opt.step()
        skipped.append(opt.skipped_steps - before)
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(total)
    full = model.state_dict()  # a collective: every rank calls it
    state = {k: v.tolist() for k, v in full.items()} if rank == 0 else None
    report = model.memory_report()
    expected = expected_report(plan, case, rank, world)
    return {
        "losses": losses,
        "norms": norms,
        "skipped": skipped,
        "state": state,
        "report": report,
        "expected_report": expected,
        "loss_scale": opt.loss_scale,
        "peak_cache_bytes": model.engine.memory_stats()["peak_cache_bytes"],
    }


def expected_report(plan, case: dict, rank: int, world: int) -> dict:
    """The plan's formulas for model-state bytes (schema.py) and the engine's other buffers (plan/memory.py)."""
    item = {"fp32": 4, "bf16": 2, "fp16": 2}[plan.training.dtype]
    per_element = SHARD_BYTES_PER_ELEMENT["adam" if case.get("optimizer", "adamw") != "sgd" else "sgd_momentum"]
    shard = plan.memory.chunk_size // world
    chunks = plan.memory.chunks
    return {
        "cache_bytes": plan.memory.cache_blocks * plan.memory.chunk_size * item,
        "resident_bytes": sum(plan.memory.chunk_size * item for c in chunks if c.resident),
        "device_shard_bytes": sum(shard * per_element for c in chunks if not c.offload),
        "host_shard_bytes": sum(shard * per_element for c in chunks if c.offload),
        **transient_bytes(
            plan.memory.chunk_size,
            world,
            plan.training.dtype,
            plan.memory.staging_buffers,
            sum(c.offload for c in chunks),
            pinned=False,
            device_is_host=True,
        ),
    }


def run_reference(case: dict, world: int) -> dict:
    model, opt, scheduler = build(case)
    autocast = case.get("dtype", "fp32") == "bf16"
    losses, norms = [], []
    for step, batch in enumerate(global_batches(case, world)):
        if case.get("alternate_extra"):
            model.use_extra = step % 3 == 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        if case.get("clip"):
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])))
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "state": {k: v.tolist() for k, v in model.state_dict().items()}}


def compare(engine: dict, reference: dict, world_losses: list[float]) -> dict:
    """Largest relative loss difference and absolute weight difference."""
    loss_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(world_losses, reference["losses"], strict=True))
    weight = 0.0
    assert set(engine["state"]) == set(reference["state"]), set(engine["state"]) ^ set(reference["state"])
    for key, ref in reference["state"].items():
        a = torch.tensor(engine["state"][key])
        b = torch.tensor(ref)
        assert a.shape == b.shape, key
        weight = max(weight, float((a.float() - b.float()).abs().max()) if a.numel() else 0.0)
    norm_rel = max(
        (abs(a - b) / max(abs(b), 1e-12) for a, b in zip(engine["norms"], reference["norms"], strict=True)), default=0.0
    )
    return {"loss_rel": loss_rel, "weight_abs": weight, "norm_rel": norm_rel}


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    """One case on this rank; rank 0 also runs the plain-PyTorch reference and compares."""
    import torch.distributed as dist

    start = time.perf_counter()
    engine = run_engine(case, rank, world)
    engine_s = time.perf_counter() - start
    losses = torch.tensor(engine["losses"], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(losses)
    engine["world_losses"] = (losses / world).tolist()
    result = {
        "case": case,
        "report": engine["report"],
        "expected_report": engine["expected_report"],
        "skipped": engine["skipped"],
        "world_losses": engine["world_losses"],
        "loss_scale": engine["loss_scale"],
        "peak_cache_bytes": engine["peak_cache_bytes"],
        "engine_s": engine_s,
    }
    if rank == 0:
        reference = run_reference(case, world)
        result.update(compare(engine, reference, engine["world_losses"]))
        result["ref_losses"] = reference["losses"]
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
