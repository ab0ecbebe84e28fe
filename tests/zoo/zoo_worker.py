"""Worker of the zoo (started by ``harness.run_zoo`` through ``engine_launch.launch``): trains each
case's model with the engine on its searched plan, under the case's loop, and compares with plain
PyTorch on the same global batches.

Each case is a dict: ``model`` (a ``models.ZOO`` name), ``loop`` ("plain" or "forward_backward"),
``plan`` (a plan YAML from the search) and ``steps``. Rank 0 also trains the reference (once per
model) and reports the largest loss and weight differences.

The two loops are written as a user's training script would be:

    plain:             for each micro-batch: loss = <loss of model(**batch)> / accum
                                             optimizer.backward(loss)
    forward_backward:  loss = model.forward_backward(micro_batches[, loss_fn=...])

then ``optimizer.step(); optimizer.zero_grad()``.
"""

from __future__ import annotations

import math
import time

import torch

import elixir_tune
from tests.zoo.harness import data_index
from tests.zoo.models import ZOO, build, global_batches

_references: dict[tuple[str, int, int], dict] = {}
_controls: dict[tuple[str, int, int, int], float] = {}


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)


def micro_batches(batch: dict, data_rank: int, data_size: int, accum: int) -> list[dict]:
    """This data index's slice of a global batch, split into ``accum`` micro-batches."""
    size = len(next(iter(batch.values())))
    if size % (data_size * accum):
        raise ValueError(f"global batch {size} does not split over {data_size} data ranks x {accum} micro-batches")
    per_micro = size // (data_size * accum)
    start = data_rank * per_micro * accum
    return [{key: value[start + k * per_micro : start + (k + 1) * per_micro] for key, value in batch.items()}
            for k in range(accum)]  # fmt: skip


def train(case: dict, model, optimizer, batches: list[dict], accum: int) -> list[float]:
    """The case's loop over the batches; this rank's loss of each step."""
    entry = ZOO[case["model"]]
    data_rank, data_size = data_index(model)
    losses = []
    for batch in batches:
        micros = micro_batches(batch, data_rank, data_size, accum)
        if case["loop"] == "plain":
            total = 0.0
            for micro in micros:
                loss = entry.loss_of(model(**micro)) / accum
                optimizer.backward(loss)
                total += float(loss.detach())
        else:
            total = float(model.forward_backward(micros, loss_fn=entry.loss_fn))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def torch_training(name: str, steps: int, global_batch: int, splits: int) -> dict:
    """Plain PyTorch on each step's global batch, accumulated over ``splits`` equal micro-batches."""
    model = build(name)
    optimizer = make_optimizer(model)
    losses = []
    for batch in global_batches(name, steps, global_batch):
        total = 0.0
        for micro in micro_batches(batch, 0, 1, splits):
            loss = ZOO[name].loss_of(model(**micro)) / splits
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def reference(name: str, steps: int, global_batch: int) -> dict:
    """Plain PyTorch on each step's whole global batch, the reference (computed once per model)."""
    key = (name, steps, global_batch)
    if key not in _references:
        _references[key] = torch_training(name, steps, global_batch, 1)
    return _references[key]


def control_difference(name: str, steps: int, global_batch: int, micro_batch: int) -> float:
    """How far plain PyTorch itself moves from the reference when it accumulates the engine's
    micro-batches (fp32 sums in another order): the floor of any engine's weight difference
    (computed once per model and micro-batch: both loops' plans take micro-batches of 2)."""
    key = (name, steps, global_batch, micro_batch)
    if key not in _controls:
        split = torch_training(name, steps, global_batch, global_batch // micro_batch)
        _controls[key] = largest_differences(split["losses"], split["state"], reference(name, steps, global_batch))[1]
    return _controls[key]


def largest_differences(losses: list[float], state: dict, ref: dict) -> tuple[float, float]:
    """Largest relative loss difference and absolute weight difference (NaN when either is not finite)."""
    loss_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref["losses"], strict=True))
    if set(state) != set(ref["state"]):
        raise AssertionError(f"state_dict names differ from torch's: {sorted(set(state) ^ set(ref['state']))}")
    weight_abs = 0.0
    for key, expected in ref["state"].items():
        got = state[key]
        if got.shape != expected.shape:
            raise AssertionError(f"{key}: shape {list(got.shape)}, torch's {list(expected.shape)}")
        if got.is_floating_point() and got.numel():
            diff = float((got.float() - expected.float()).abs().max())
            weight_abs = diff if math.isnan(diff) else max(weight_abs, diff)
    return loss_rel, weight_abs


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    """One model under one loop on this rank."""
    import torch.distributed as dist

    from elixir_tune.plan import load_plan
    from elixir_tune.profiler.source import quiet_transformers

    plan = load_plan(case["plan"])
    batches = global_batches(case["model"], case["steps"], plan.training.global_batch_size)
    start = time.perf_counter()
    model = build(case["model"])
    with quiet_transformers():
        model, optimizer = elixir_tune.setup(model, make_optimizer(model), plan=plan)
        losses = train(case, model, optimizer, batches, plan.training.grad_accum_steps)
    state = model.state_dict()  # a collective: every rank calls it; rank 0 gets the whole model
    engine_s = time.perf_counter() - start
    # Ranks of one data index report the same loss, so the mean over the world is the global batch's.
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)
    world_losses = (mean / world).tolist()
    result = {"case": case, "losses": world_losses, "engine_s": engine_s}
    if rank == 0:
        with quiet_transformers():
            ref = reference(case["model"], case["steps"], plan.training.global_batch_size)
        result["loss_rel"], result["weight_abs"] = largest_differences(world_losses, state, ref)
        with quiet_transformers():
            training = plan.training
            result["control_abs"] = control_difference(
                case["model"], case["steps"], training.global_batch_size, training.micro_batch_size
            )
        result["ref_losses"] = ref["losses"]
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
