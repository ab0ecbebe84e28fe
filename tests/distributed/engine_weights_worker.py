"""Worker for the weights tests: Hugging Face weights in and out, and meta-device initialization.

Run by ``engine_launch.py`` as N processes (torchrun environment). Each case is a dict:

    kind "hf":   dir (a directory written by plain transformers ``save_pretrained``), out (where the
                 engine's ``save_pretrained`` writes), chunk_size, offload, steps. The model is built
                 on the meta device from the directory's config.json and loaded with
                 ``setup(..., weights=dir)``; every rank compares its first-step loss on its own
                 micro-batch with plain ``from_pretrained`` on the same micro-batch; after ``steps``
                 steps the engine writes ``out`` and rank 0 loads it with plain ``from_pretrained``.
    kind "init": arch (gpt2 | llama | torch), seed, chunk_size, offload: a meta-device model
                 initialized by the engine; rank 0 returns the full initial weights and buffers.

Initialization units are made small here (``UNIT_NUMEL``) so that the tiny models are cut into many
units and the chunk boundaries fall inside and across them.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import elixir_tune
from elixir_tune.engine.io import initializer
from tests.distributed.engine_launch import worker_main
from tests.distributed.engine_plans import make_plan, tiny_gpt2_config

SEQ = 8
VOCAB = 64
SMALL_UNIT_NUMEL = 600


def hf_config(arch: str):
    from transformers import LlamaConfig

    if arch == "gpt2":
        return tiny_gpt2_config()
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def torch_model() -> nn.Module:
    """A plain torch model (no transformers): modules' reset_parameters() initialize it."""
    return nn.Sequential(
        nn.Embedding(VOCAB, 16), nn.LayerNorm(16), nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 16), nn.Linear(16, 8)
    )


def meta_model(arch: str, directory: str | None = None) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        if arch == "torch":
            return torch_model()
        config = AutoConfig.from_pretrained(directory) if directory else hf_config(arch)
        return AutoModelForCausalLM.from_config(config)


def micro_batch(rank: int, step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def run_hf(case: dict, rank: int, world: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = meta_model("", case["dir"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    plan = make_plan(model, world, case["chunk_size"], offload=case.get("offload", 0.0))
    model, opt = elixir_tune.setup(model, opt, plan=plan, weights=case["dir"])
    plain = AutoModelForCausalLM.from_pretrained(case["dir"])
    batch = micro_batch(rank, 0)
    with torch.no_grad():
        plain_loss = float(plain(**batch).loss)
    losses = []
    for step in range(case["steps"]):
        loss = model(**micro_batch(rank, step)).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    elixir_tune.save_pretrained(model, case["out"], max_shard_size=case.get("max_shard_size", "5GB"))
    state = model.state_dict()  # rank 0 only
    result = {"first_loss": losses[0], "plain_loss": plain_loss, "state_keys": sorted(state)}
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(case["out"]).state_dict()
        result["saved_diff"] = max(float((loaded[k] - v).abs().max()) for k, v in state.items())
        result["saved_keys_missing"] = sorted(set(state) - set(loaded))
        result["moved"] = max(float((plain.state_dict()[k] - v).abs().max()) for k, v in state.items())
        result["files"] = sorted(os.listdir(case["out"]))
    return result


def run_init(case: dict, rank: int, world: int) -> dict:
    model = meta_model(case["arch"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = make_plan(model, world, case["chunk_size"], offload=case.get("offload", 0.0))
    model, opt = elixir_tune.setup(model, opt, plan=plan, seed=case["seed"])
    state = model.state_dict()
    buffers = {k: v.tolist() for k, v in model.module.named_buffers()}
    return {
        "state": {k: v.tolist() for k, v in state.items()} if rank == 0 else None,
        "buffers": buffers,
        "chunks": len(plan.memory.chunks),
    }


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    result = run_hf(case, rank, world) if case["kind"] == "hf" else run_init(case, rank, world)
    return dict(result, case=case)


if __name__ == "__main__":
    initializer.UNIT_NUMEL = SMALL_UNIT_NUMEL
    worker_main(run_case)
