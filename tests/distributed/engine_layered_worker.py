"""Worker for the layered-accumulation tests: GPT-2 and a Llama-style tiny model trained through
``ElixirModel.forward_backward`` with ``training.accumulation: layered`` (and standard, for the
counters), compared with plain PyTorch on the same global batch.

Run by ``engine_launch.py`` as N processes. Each case is a dict:

    arch: gpt2 | llama | opt (tied head)     offload (fraction)     checkpoint (every)     accum     steps
    mode: layered | standard     chunk_size     cache ("min" | "all" | int)     prefetch

Rank 0 also trains the plain-PyTorch reference (fp32) and reports the largest differences.
Every rank reports the engine's counters (gathers, uploads, reduce-scatters) of the last step.
"""

from __future__ import annotations

import time

import torch

import elixir_tune
from tests.distributed.engine_archs_worker import BLOCK_LIST, build_model
from tests.distributed.engine_plans import batches, make_plan, param_groups, tiny_gpt2
from tests.distributed.engine_worker import compare, local_micro, mean_over_ranks, plain_training

SEQ = 8
MICRO = 2
COUNTERS = ("gathers", "uploads", "reduce_scatters")


def build(case: dict):
    if case["arch"] == "gpt2":
        model = tiny_gpt2()
    else:
        model = build_model(dict(arch=case["arch"], tied=case["arch"] == "opt"))
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    return model, opt


def block_list(case: dict) -> str:
    return "transformer.h" if case["arch"] == "gpt2" else BLOCK_LIST[case["arch"]]


def run_engine(case: dict, rank: int, world: int) -> dict:
    model, opt = build(case)
    accum = case["accum"]
    plan = make_plan(
        model,
        world,
        case["chunk_size"],
        cache=case.get("cache", "min"),
        offload=case.get("offload", 0.0),
        prefetch=case.get("prefetch", 0),
        checkpoint_every=case.get("checkpoint", 0),
        block_list=block_list(case),
        micro_batch_size=MICRO,
        grad_accum_steps=accum,
        seq_len=SEQ,
    )
    plan.training.accumulation = case["mode"]
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    losses, counts = [], {}
    for batch in batches(case["steps"], MICRO * accum * world, SEQ):
        before = model.engine.memory_stats()
        loss = model.forward_backward([local_micro(batch, rank, world, accum, k) for k in range(accum)])
        after = model.engine.memory_stats()
        counts = {key: after[key] - before[key] for key in COUNTERS}  # forward and backward of one step
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    full = model.state_dict()  # a collective: every rank calls it
    # The same plan's cost for a single micro-batch: what layered accumulation should cost for N.
    before = model.engine.memory_stats()
    model.forward_backward([local_micro(batch, rank, world, accum, 0)])
    after = model.engine.memory_stats()
    return {
        "single_counts": {key: after[key] - before[key] for key in COUNTERS},
        "losses": losses,
        "norms": [],
        "state": {k: v.tolist() for k, v in full.items()} if rank == 0 else None,
        "counts": counts,
        "chunks": len(plan.memory.chunks),
        "cache_blocks": plan.memory.cache_blocks,
        "global_batch": plan.training.global_batch_size,
    }


def run_reference(case: dict, global_batch: int) -> dict:
    model, opt = build(case)
    return plain_training(model, opt, batches(case["steps"], global_batch, SEQ))


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    from elixir_tune.profiler.source import quiet_transformers

    start = time.perf_counter()
    with quiet_transformers():
        engine = run_engine(case, rank, world)
    result = {
        "case": case,
        "world_losses": mean_over_ranks(engine["losses"], world),
        "counts": engine["counts"],
        "single_counts": engine["single_counts"],
        "chunks": engine["chunks"],
        "cache_blocks": engine["cache_blocks"],
        "engine_s": time.perf_counter() - start,
    }
    if rank == 0:
        with quiet_transformers():
            reference = run_reference(case, engine["global_batch"])
        result.update(compare(engine, reference, result["world_losses"]))
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
