"""Worker for the engine's family tests: encoder-decoder (BART, T5), mixture-of-experts (Qwen2-MoE,
fused experts) and a vision transformer, each profiled, searched and trained with the engine, and
compared with plain PyTorch on the same global batch.

Run by ``engine_launch.py`` as N processes. Each case is a dict:

    family: bart | t5 | moe | vit     steps     global_batch
    one_token_rank: the rank whose batch is a single repeated token (moe): all its tokens route
        to the same two experts, so the other experts get no tokens there but do on other ranks

Plans come from the real profiler and search: half the shards offloaded, the smallest cache the
chunking allows, every block checkpointed.
"""

from __future__ import annotations

import os
import tempfile

import torch

import elixir_tune
from tests.distributed.engine_worker import compare, mean_over_ranks, plain_training, train_steps

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit", "models")
SPECS = {
    "bart": f"{MODELS}/families.py:build_bart",
    "t5": f"{MODELS}/families.py:build_t5",
    "moe": f"{MODELS}/families.py:build_moe",
    "vit": f"{MODELS}/vit_tiny.py",
}
SEQ = 8
# Small enough that each model spreads over several chunks; the fused experts hold 8192 elements, the ViT patch projection 6144.
CHUNK_SIZE = {"bart": 4096, "t5": 4096, "moe": 8192, "vit": 8192}
VOCAB = 128


def build(case: dict):
    from elixir_tune.profiler import load_model_source

    torch.manual_seed(0)
    model = load_model_source(SPECS[case["family"]]).build_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    return model, opt


def global_batches(case: dict, world: int) -> list[dict[str, torch.Tensor]]:
    """Deterministic global batches, the same in every process."""
    generator = torch.Generator().manual_seed(1)
    size = case["global_batch"]
    out = []
    for _ in range(case["steps"]):
        if case["family"] == "vit":
            out.append(
                {"pixel_values": torch.randn(size, 3, 32, 32, generator=generator),
                 "labels": torch.randint(0, 10, (size,), generator=generator)}
            )  # fmt: skip
            continue
        ids = torch.randint(1, VOCAB, (size, SEQ), generator=generator)
        if case.get("one_token_rank") is not None:
            per_rank = size // world
            start = case["one_token_rank"] * per_rank
            ids[start : start + per_rank] = 7
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def search_plan(case: dict, world: int):
    """Profile on the meta device, then search with the smallest cache and half offloaded."""
    from elixir_tune.costmodel import CostModel
    from elixir_tune.hardware import load_hardware
    from elixir_tune.profiler import profile_model
    from elixir_tune.search import search

    with tempfile.TemporaryDirectory():
        profile = profile_model(SPECS[case["family"]], batch_size=2, seq_len=SEQ, checkpointing="all")
    hardware = load_hardware("cpu")
    min_cache = CostModel(profile, hardware, world).min_cache_blocks(CHUNK_SIZE[case["family"]], 1)
    fixed = {
        "chunk_size": CHUNK_SIZE[case["family"]],
        "offload": 0.5,
        "checkpointing": "all",
        "cache_blocks": min_cache,
        "prefetch": 0,
        "micro_batch_size": 2,
        # the chunk engine's data-parallel path: no pipeline or tensor layout
        "pipeline": 1,
        "tensor": 1,
    }
    return search(profile, hardware, gpus_per_node=world, global_batch_size=case["global_batch"], fixed=fixed).plan


def experts_seen(model: torch.nn.Module) -> tuple[list, set[int]]:
    """Hooks the first MoE layer's experts: the set of experts that got tokens in this rank's steps."""
    seen: set[int] = set()
    experts = model.model.layers[0].mlp.experts
    handle = experts.register_forward_pre_hook(lambda module, args: seen.update(args[1].flatten().tolist()))
    return [handle], seen


def run_engine(case: dict, rank: int, world: int) -> dict:
    model, opt = build(case)
    plan = search_plan(case, world)
    accum = plan.training.grad_accum_steps
    handles, seen = experts_seen(model) if case["family"] == "moe" else ([], set())
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    losses = train_steps(model, opt, global_batches(case, world), rank, world, accum)
    for handle in handles:
        handle.remove()
    full = model.state_dict()  # a collective: every rank calls it
    return {
        "losses": losses,
        "norms": [],
        "state": {k: v.tolist() for k, v in full.items()} if rank == 0 else None,
        "experts_seen": sorted(seen),
        "plan": {
            "chunks": len(plan.memory.chunks),
            "cache_blocks": plan.memory.cache_blocks,
            "offloaded": sum(c.offload for c in plan.memory.chunks),
            "resident": sum(c.resident for c in plan.memory.chunks),
            "checkpoint_every": plan.training.activation_checkpointing.every,
            "block_list": plan.model.block_list,
        },
    }


def run_reference(case: dict, world: int) -> dict:
    model, opt = build(case)
    return plain_training(model, opt, global_batches(case, world))


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    """One case on this rank; rank 0 also runs the plain-PyTorch reference and compares."""
    engine = run_engine(case, rank, world)
    world_losses = mean_over_ranks(engine["losses"], world)
    result = {
        "case": case,
        "plan": engine["plan"],
        "experts_seen": engine["experts_seen"],
        "world_losses": world_losses,
    }
    if rank == 0:
        reference = run_reference(case, world)
        result.update(compare(engine, reference, world_losses))
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
