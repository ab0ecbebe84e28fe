"""Worker for the LoRA tests: a tiny Llama with PEFT LoRA adapters on the chunk engine (gloo, CPU).

Cases (``kind``):

* ``train``: 10 AdamW steps on the engine (frozen base in frozen chunks, sharded; some chunks
  offloaded; the fewest cache blocks) against plain PEFT on one process over the same global
  batches, computed in this process; then ``save_adapter`` and, on rank 0, the adapter loaded with
  ``PeftModel.from_pretrained`` over a fresh base, whose logits are compared to the engine's; then
  ``save_merged`` loaded with plain ``AutoModelForCausalLM``.
* ``weights``: a LoRA model built on the meta device, its base read from a Hugging Face directory
  by ``setup(weights=DIR)``: the base equals the file, ``lora_B`` is zero and ``lora_A`` is
  ``adapter_init``'s, on every world size alike; with ``stages`` or ``tensor`` on pipeline stages or
  in tensor pieces (each split adapter starting as its piece).
* ``parallel``: 3 AdamW steps of ``forward_backward`` under a pipeline (``stages``) or 1d tensor
  (``tensor``, ``sequence_parallel``) plan against plain PEFT on each step's batch; what the frozen
  chunks hold and how the LoRA layers' parts are placed; the saved adapter (``PeftModel.from_pretrained``)
  and merged directory against plain PEFT's adapters and ``merge_and_unload``.
* ``memory`` (scripts/bench_lora_memory.py): a profile (with or without LoRA) and a search of a
  Hugging Face directory, then one warm-up and one measured step (``memory_probe``) against the
  plan's predicted peak.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import elixir_tune
from elixir_tune.models.lora import adapter_init, apply_lora, save_adapter, save_merged
from tests.distributed.engine_launch import worker_main
from tests.distributed.engine_plans import make_plan

VOCAB = 64
SEQ = 16
STEPS = 10
MICRO = 2  # per rank; the global batch is MICRO x world
LR = 1e-2
LORA = dict(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )


def base_model(seed: int = 0):
    import transformers
    from transformers import LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config())


def lora_model(seed: int = 0):
    model = apply_lora(base_model(seed), **LORA)
    torch.manual_seed(seed + 1)
    # PEFT starts lora_B at zero; a random start makes the first steps' adapter gradients and the
    # loss depend on both matrices from step one.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.02)
    return model


def global_batches(world: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=generator) for _ in range(STEPS)]


def reference_run(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PEFT on one process: losses and the trained adapters."""
    model = lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for ids in global_batches(world):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_train(case: dict, rank: int, world: int) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = lora_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = make_plan(
        model,
        world,
        case["chunk_size"],
        cache="min",
        offload=case["offload"],
        micro_batch_size=MICRO,
        seq_len=SEQ,
        frozen_chunks=True,
    )
    # The user's optimizer over model.parameters(): the frozen ones get no gradient and no state.
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
    engine = model.engine
    losses = []
    for ids in global_batches(world):
        mine = ids[rank * MICRO : (rank + 1) * MICRO]
        loss = model(input_ids=mine, labels=mine).loss
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    full = engine.full_state_dict()
    adapters = engine.full_state_dict(trainable_only=True)
    probe = global_batches(world)[0][:2]
    with torch.no_grad():
        logits = model(input_ids=probe).logits.detach().clone()
    save_adapter(model, case["out"] + "/adapter")
    save_merged(model, case["out"] + "/merged")
    out: dict = {
        "losses": losses,
        "frozen_chunks": sum(c.frozen for c in plan.memory.chunks),
        "offloaded_frozen": sum(c.frozen and c.offload for c in plan.memory.chunks),
        "chunks": len(plan.memory.chunks),
        "report": engine.memory_report(),
        "frozen_shard_bytes": sum(c.shard_bytes() + c.optimizer_state_bytes for c in engine.chunks if c.frozen),
        "frozen_shard_numel": sum(c.shard_numel for c in engine.chunks if c.frozen),
    }
    if rank != 0:
        return out
    ref_losses, ref_adapters = reference_run(world)
    out["reference_losses"] = ref_losses
    out["adapter_names"] = sorted(adapters)
    out["adapter_max_diff"] = max(float((adapters[n] - ref_adapters[n]).abs().max()) for n in ref_adapters)
    out["adapters_moved"] = min(float((ref_adapters[n] - initial[n]).abs().max()) for n in ref_adapters)
    frozen = [n for n in initial if n not in ref_adapters]
    out["base_unchanged"] = all(torch.equal(full[n], initial[n]) for n in frozen)
    out["base_checked"] = len(frozen)
    # The saved adapter over a fresh base (same seed: the same base weights) gives the same logits.
    loaded = PeftModel.from_pretrained(base_model(), case["out"] + "/adapter")
    with torch.no_grad():
        out["adapter_logits_diff"] = float((loaded(input_ids=probe).logits - logits).abs().max())
        merged = AutoModelForCausalLM.from_pretrained(case["out"] + "/merged")
        out["merged_logits_diff"] = float((merged(input_ids=probe).logits - logits).abs().max())
    out["merged_has_adapters"] = any("lora" in n for n, _ in merged.named_parameters())
    return out


PARALLEL_STEPS = 3
PARALLEL_ACCUM = 2  # micro-batches per step, every rank the same ones (one data index)


def parallel_batches() -> list[list[dict]]:
    generator = torch.Generator().manual_seed(4)
    steps = []
    for _ in range(PARALLEL_STEPS):
        ids = [torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator) for _ in range(PARALLEL_ACCUM)]
        steps.append([{"input_ids": x, "labels": x} for x in ids])
    return steps


def parallel_reference() -> tuple[list[float], Any, dict[str, torch.Tensor]]:
    """Plain PEFT on one process over each step's micro-batches as one batch: losses, the trained model
    and its adapters."""
    model = lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for micro in parallel_batches():
        ids = torch.cat([batch["input_ids"] for batch in micro])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, model, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_parallel(case: dict, rank: int, world: int) -> dict:
    """LoRA under a pipeline (``stages``) or 1d tensor (``tensor``) plan against plain PEFT; the saved
    adapter and merged model read back on rank 0."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from elixir_tune.models.stage_plans import resolve_stage_plan
    from elixir_tune.plan.tensor_layout import local_shape

    stages, tensor = case.get("stages", 1), case.get("tensor", 1)
    model = lora_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    stage_plan = resolve_stage_plan(model)
    assert not isinstance(stage_plan, str), stage_plan
    plan = make_plan(
        model, world, case["chunk_size"], offload=case.get("offload", 0.0), micro_batch_size=MICRO,
        grad_accum_steps=PARALLEL_ACCUM, seq_len=SEQ, frozen_chunks=True, stages=stages, tensor=tensor,
        block_list=stage_plan.block_list if stages > 1 else "", sequence_parallel=case.get("sequence_parallel", True),
    )  # fmt: skip
    full_numel = {n: p.numel() for n, p in model.named_parameters()}
    table = plan.model.tensor_layout
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
    engine = model.engine
    losses = []
    for micro in parallel_batches():
        loss = model.forward_backward(micro)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    full = model.state_dict()
    save_adapter(model, case["out"] + "/adapter")
    save_merged(model, case["out"] + "/merged")
    frozen_slots = [slot for chunk in engine.chunks if chunk.frozen for slot in chunk.slots]
    out: dict = {
        "losses": losses,
        "frozen_chunks": sum(c.frozen for c in engine.chunks),
        "frozen_shard_bytes": sum(c.shard_bytes() + c.optimizer_state_bytes for c in engine.chunks if c.frozen),
        "frozen_shard_numel": sum(c.shard_numel for c in engine.chunks if c.frozen),
        # Each frozen slot holds this rank's piece: the table's local shape (a DTensor's local shard).
        "frozen_local": all(
            slot.numel == math.prod(local_shape(slot.name, list(slot.param.shape), "llama", tensor, "1d", table))
            for slot in frozen_slots
        ),
        "frozen_split": sum(slot.numel < full_numel[slot.name] for slot in frozen_slots),
        "frozen_names": sorted(slot.name for slot in frozen_slots),
        # How tensor parallelism placed each part of block 0's LoRA layers (None: a plain tensor).
        "placements": {
            name.partition("layers.0.")[2]: str(getattr(param, "placements", None))
            for name, param in model.module.named_parameters()
            if "layers.0." in name and (".lora_" in name or ".base_layer." in name)
        },
    }
    if rank != 0:
        return out
    ref_losses, reference, ref_adapters = parallel_reference()
    out["reference_losses"] = ref_losses
    out["adapter_max_diff"] = max(float((full[n] - ref_adapters[n]).abs().max()) for n in ref_adapters)
    out["adapters_moved"] = min(float((ref_adapters[n] - initial[n]).abs().max()) for n in ref_adapters)
    frozen = [n for n in initial if n not in ref_adapters]
    out["base_unchanged"] = all(torch.equal(full[n], initial[n]) for n in frozen)
    out["base_checked"] = len(frozen)
    loaded = PeftModel.from_pretrained(base_model(), case["out"] + "/adapter")
    loaded_state = dict(loaded.named_parameters())
    out["loaded_adapter_diff"] = max(float((loaded_state[n] - ref_adapters[n]).abs().max()) for n in ref_adapters)
    merged = AutoModelForCausalLM.from_pretrained(case["out"] + "/merged").state_dict()
    ref_merged = reference.merge_and_unload().state_dict()
    out["merged_keys_equal"] = sorted(merged) == sorted(ref_merged)
    out["merged_diff"] = max(float((merged[n] - ref_merged[n]).abs().max()) for n in ref_merged)
    return out


def run_weights(case: dict, rank: int, world: int) -> dict:
    from safetensors.torch import load_file

    with torch.device("meta"):
        model = apply_lora(base_model(), **LORA)
    stages, tensor = case.get("stages", 1), case.get("tensor", 1)
    block_list = "base_model.model.model.layers" if stages > 1 else ""
    plan = make_plan(
        model, world, case["chunk_size"], offload=case["offload"], seq_len=SEQ, frozen_chunks=True, stages=stages,
        tensor=tensor, block_list=block_list, grad_accum_steps=PARALLEL_ACCUM if stages > 1 else 1,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = elixir_tune.setup(model, optimizer, plan=plan, weights=case["dir"], seed=5)
    full = model.state_dict()  # every stage's and tensor rank's pieces, on rank 0
    if rank != 0:
        return {}
    saved = load_file(case["dir"] + "/model.safetensors")
    base_diffs, adapter_diffs = [], []
    for name, value in full.items():
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if plain in saved:
            base_diffs.append(torch.equal(value, saved[plain].float()))
        elif ".lora_" in name:
            adapter_diffs.append(float((value - adapter_init(name, value.shape, 5)).abs().max()))
    b_zero = all(float(v.abs().max()) == 0 for n, v in full.items() if ".lora_B." in n)
    return {
        "base_equal": all(base_diffs),
        "bases": len(base_diffs),
        "adapter_diff": max(adapter_diffs),
        "b_zero": b_zero,
    }


def run_memory(case: dict, rank: int, world: int) -> dict:
    from elixir_tune.hardware import load_hardware
    from elixir_tune.profiler import load_model_source, profile_model
    from elixir_tune.search import search
    from tests.distributed.memory_probe import peak_step_bytes

    lora = case["lora"]
    source = load_model_source(case["dir"])
    profile = profile_model(source, batch_size=case["micro"], seq_len=case["seq"], lora=lora)
    fixed = dict(case["fixed"], micro_batch_size=case["micro"], dtype="fp32", pipeline=1, tensor=1)
    result = search(
        profile, load_hardware("cpu"), gpus_per_node=world, global_batch_size=case["micro"] * world, fixed=fixed
    )
    plan = result.plan
    torch.manual_seed(0)
    model = source.build_model()
    if lora:
        model = apply_lora(model, **lora)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
    batch = source.example_batch(case["micro"], case["seq"])

    def step() -> None:
        loss = model(**batch).loss
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    measured = peak_step_bytes(step, model.engine.device, warmup=step)
    memory = result.candidates[0].memory
    return {
        "measured": measured,
        "predicted_gpu_bytes": memory.peak_gpu_bytes,
        "predicted_host_bytes_per_rank": memory.peak_host_bytes // world,
        "model_state_bytes": dict(memory.model_state_bytes),
        "report": model.engine.memory_report(),
        "trainable": sum(p.numel for p in profile.params if p.requires_grad),
        "params": profile.num_params,
        "chunks": len(plan.memory.chunks),
        "frozen_chunks": sum(c.frozen for c in plan.memory.chunks),
        "offloaded": sum(c.offload for c in plan.memory.chunks),
        "cache_blocks": plan.memory.cache_blocks,
        "chunk_size": plan.memory.chunk_size,
    }


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    if case["kind"] == "train":
        return run_train(case, rank, world)
    if case["kind"] == "parallel":
        return run_parallel(case, rank, world)
    if case["kind"] == "memory":
        return run_memory(case, rank, world)
    return run_weights(case, rank, world)


if __name__ == "__main__":
    worker_main(run_case)
