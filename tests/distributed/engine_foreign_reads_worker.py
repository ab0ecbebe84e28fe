"""Worker for the foreign-reads tests: a tiny transformers Mamba (``MambaForCausalLM``), whose mixer
reads ``conv1d.weight``/``bias`` and ``dt_proj.weight``/``bias`` with functional calls instead of
calling those modules, profiled, searched and trained with the engine, and compared with plain
PyTorch on the same global batch.

Run by ``engine_launch.py`` as N processes. Each case is a dict:

    checkpointing: none | all     steps     global_batch
    drop_reads: remove the plan's record of the mixers' reads (model.foreign_reads): the first
        step must stop with the engine's UngatheredRead on every rank

Plans come from the real profiler and search: half the shards offloaded, no prefetch, chunks small
enough that the model spreads over several, and one cache block more than the cost model's
minimum (a mixer's chunks stay gathered while its children run).
"""

from __future__ import annotations

import os

import torch

import elixir_tune
from elixir_tune.engine import UngatheredRead
from tests.distributed.engine_worker import compare, mean_over_ranks, plain_training, train_steps

SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit", "models", "mamba_tiny.py")
SEQ = 8
CHUNK_SIZE = 4096  # the embedding holds 4096 elements; the model has 21,472 in all
VOCAB = 128


def build():
    from elixir_tune.profiler import load_model_source

    torch.manual_seed(0)
    model = load_model_source(SPEC).build_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    return model, opt


def global_batches(case: dict) -> list[dict[str, torch.Tensor]]:
    """Deterministic global batches, the same in every process."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(case["steps"]):
        ids = torch.randint(1, VOCAB, (case["global_batch"], SEQ), generator=generator)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def search_plan(case: dict, world: int):
    from elixir_tune.costmodel import CostModel
    from elixir_tune.hardware import load_hardware
    from elixir_tune.profiler import profile_model
    from elixir_tune.search import search

    profile = profile_model(SPEC, batch_size=2, seq_len=SEQ, checkpointing="all")
    hardware = load_hardware("cpu")
    every = 1 if case["checkpointing"] == "all" else 0
    min_cache = CostModel(profile, hardware, world).min_cache_blocks(CHUNK_SIZE, every)
    fixed = {
        "chunk_size": CHUNK_SIZE,
        "offload": 0.5,
        "checkpointing": case["checkpointing"],
        "cache_blocks": min_cache,  # the smallest the search allows: setup must accept it
        "prefetch": 0,
        "micro_batch_size": 2,
        "pipeline": 1,
        "tensor": 1,
    }
    plan = search(profile, hardware, gpus_per_node=world, global_batch_size=case["global_batch"], fixed=fixed).plan
    return profile, plan


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    """One case on this rank; rank 0 also runs the plain-PyTorch reference and compares."""
    profile, plan = search_plan(case, world)
    summary = {
        "foreign_reads": [[read.module, list(read.params)] for read in plan.model.foreign_reads],
        "chunks": len(plan.memory.chunks),
        "cache_blocks": plan.memory.cache_blocks,
        "offloaded": sum(c.offload for c in plan.memory.chunks),
        "resident": sum(c.resident for c in plan.memory.chunks),
        "checkpoint_every": plan.training.activation_checkpointing.every,
    }
    if case.get("drop_reads"):
        plan.model.foreign_reads = []
    model, opt = build()
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    result: dict = {"case": case, "plan": summary}
    try:
        losses = train_steps(model, opt, global_batches(case), rank, world, plan.training.grad_accum_steps)
    except UngatheredRead as error:
        if not case.get("drop_reads"):
            raise
        return dict(result, error=str(error))
    result["gathers"] = model.engine.memory_stats()["gathers"]
    full = model.state_dict()  # a collective: every rank calls it
    result["world_losses"] = mean_over_ranks(losses, world)
    if rank == 0:
        reference = plain_training(*build(), global_batches(case))
        engine = {"losses": losses, "norms": [], "state": {k: v.tolist() for k, v in full.items()}}
        result.update(compare(engine, reference, result["world_losses"]))
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
