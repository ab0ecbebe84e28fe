"""Worker for the engine's architecture tests: tiny Llama and OPT (tied and untied) trained with the
engine and compared with plain PyTorch on the same global batch.

Run by ``engine_launch.py`` as N processes (torchrun environment). Each case is a dict:

    arch: llama | opt           tied: tie_word_embeddings     proj: OPT-350m shape (opt only)
    plan: "helper" (engine_plans.make_plan with chunk_size, cache, offload, prefetch, checkpoint,
          accum) or "search" (the real profiler on a model YAML, then the real search with
          ``fixed`` pins; micro-batch and accumulation come from the search's plan)
    steps, global_batch (search plans), dtype (helper plans; bf16 is compared with autocast)

Rank 0 also trains the plain-PyTorch reference (fp32) and reports the largest differences.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import yaml

import elixir_tune
from tests.distributed.engine_plans import VOCAB, batches, param_groups, plan_for_case
from tests.distributed.engine_worker import compare, mean_over_ranks, train_steps

SEQ = 8
BLOCK_LIST = {"llama": "model.layers", "opt": "model.decoder.layers"}


def arch_config(case: dict) -> dict:
    """Tiny transformers config fields (no dropout: the engine and the reference must agree)."""
    if case["arch"] == "llama":
        return dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            tie_word_embeddings=case["tied"],
            use_cache=False,
        )
    # ``proj`` is the OPT-350m shape: embeddings narrower than the hidden size (project_in/out
    # Linear layers around the decoder) and post-layer-norm blocks.
    proj = case.get("proj", False)
    return dict(
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        word_embed_proj_dim=16 if proj else 32,
        do_layer_norm_before=not proj,
        dropout=0.0,
        attention_dropout=0.0,
        layerdrop=0.0,
        tie_word_embeddings=case["tied"],
        use_cache=False,
    )


def model_yaml(case: dict, directory: str) -> str:
    """A model YAML as users write them (configs/models/), for the profiler's loader."""
    path = os.path.join(
        directory,
        f"tiny-{case['arch']}-{'tied' if case['tied'] else 'untied'}{'-proj' if case.get('proj') else ''}.yaml",
    )
    with open(path, "w") as f:
        yaml.safe_dump(
            {
                "name": os.path.basename(path)[:-5],
                "architecture": case["arch"],
                "seq_len": SEQ,
                "config": arch_config(case),
            },
            f,
        )
    return path


def build_model(case: dict) -> torch.nn.Module:
    """The model through the same loader the profiler uses (so the plan's fingerprint matches)."""
    from elixir_tune.profiler import load_model_source

    with tempfile.TemporaryDirectory() as tmp:
        source = load_model_source(model_yaml(case, tmp))
        torch.manual_seed(0)
        model = source.build_model()
    model.train()
    return model


def build(case: dict):
    model = build_model(case)
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    return model, opt


def search_plan(case: dict, world: int):
    """Profile on the meta device and search, the way ``elixir-tune profile`` + ``search`` do."""
    from elixir_tune.hardware import load_hardware
    from elixir_tune.profiler import load_model_source, profile_model
    from elixir_tune.search import search

    with tempfile.TemporaryDirectory() as tmp:
        source = load_model_source(model_yaml(case, tmp))
        profile = profile_model(source, batch_size=2, seq_len=SEQ, dtype="fp32", checkpointing="all")
    # The chunk engine's data-parallel path: no pipeline or tensor layout (those have tests of their own).
    fixed = {**case["fixed"], "pipeline": 1, "tensor": 1}
    result = search(
        profile, load_hardware("cpu"), gpus_per_node=world, global_batch_size=case["global_batch"], fixed=fixed
    )
    return result.plan


def make_case_plan(case: dict, model: torch.nn.Module, world: int):
    if case["plan"] == "search":
        return search_plan(case, world)
    return plan_for_case(model, world, case, BLOCK_LIST[case["arch"]], SEQ)


def run_engine(case: dict, rank: int, world: int) -> dict:
    model, opt = build(case)
    plan = make_case_plan(case, model, world)
    accum = plan.training.grad_accum_steps
    global_batch = plan.training.global_batch_size
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    losses = train_steps(model, opt, batches(case.get("steps", 12), global_batch, SEQ), rank, world, accum)
    full = model.state_dict()  # a collective: every rank calls it
    memory = plan.memory
    return {
        "losses": losses,
        "norms": [],
        "state": {k: v.tolist() for k, v in full.items()} if rank == 0 else None,
        "global_batch": global_batch,
        "plan": {
            "chunk_size": memory.chunk_size,
            "chunks": len(memory.chunks),
            "cache_blocks": memory.cache_blocks,
            "prefetch": memory.prefetch,
            "offloaded": sum(c.offload for c in memory.chunks),
            "resident": sum(c.resident for c in memory.chunks),
            "checkpoint_every": plan.training.activation_checkpointing.every,
            "micro": plan.training.micro_batch_size,
            "accum": accum,
        },
    }


def run_reference(case: dict, global_batch: int) -> dict:
    model, opt = build(case)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    losses = []
    autocast = case.get("dtype", "fp32") == "bf16"  # the engine's bf16: bf16 weights, fp32 master
    for batch in batches(case.get("steps", 12), global_batch, SEQ):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    # How far training moved the weights: the weight tolerance is only meaningful well below it.
    moved = max(float((v - initial[k]).abs().max()) for k, v in model.state_dict().items() if v.is_floating_point())
    return {
        "losses": losses,
        "norms": [],
        "moved": moved,
        "state": {k: v.tolist() for k, v in model.state_dict().items()},
    }


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    """One architecture case on this rank; rank 0 also runs the plain-PyTorch reference."""
    from elixir_tune.profiler.source import quiet_transformers

    start = time.perf_counter()
    with quiet_transformers():
        engine = run_engine(case, rank, world)
    world_losses = mean_over_ranks(engine["losses"], world)
    result = {
        "case": case,
        "world_losses": world_losses,
        "plan": engine["plan"],
        "engine_s": time.perf_counter() - start,
    }
    if rank == 0:
        with quiet_transformers():
            reference = run_reference(case, engine["global_batch"])
        result.update(compare(engine, reference, world_losses))
        result["ref_losses"] = reference["losses"]
        result["moved"] = reference["moved"]
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
