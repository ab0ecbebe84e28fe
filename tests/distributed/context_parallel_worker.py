"""Worker for the context-parallel tests (``parallel.context``, Ulysses): trains a tiny transformers
model with every sequence split over a context group and returns what rank 0 compares with plain
PyTorch on the whole global batch.

Run by ``engine_launch.py`` (gloo, CPU). Each case is a dict:

    model: gpt2 | llama | mistral | zoo:NAME (tests/zoo/models.py)    attn: sdpa | eager    context: C (world: data x C)
    loop: plain (``model(**batch)``, ``optimizer.backward``) | forward_backward
    accum: micro-batches per step    padded: right-padded rows (attention_mask 0, labels -100)
    checkpoint: every k-th block recomputed     offload: share of chunks on the host
    slice_by_rank: feed each rank its own rows by RANK (the mistake the first forward must catch)
    packed: position_ids restarting inside the rows (packed documents), which must be refused
    lora: LoRA adapters (PEFT, rank 4 on q/v and the MLP's down projection), the base in frozen chunks
    tensor: tensor degree T (1D, sequence-parallel; world: data x C x T)
    stages: pipeline stages P (loop forward_backward; world: data x P x C)
    control: also run plain PyTorch with o_proj and down_proj summed over two halves of their input
        (tensor 2's order): ``control_weight_abs`` is its weight difference from the reference; "attention":
        plain PyTorch with the other attention implementation (eager for sdpa) instead
"""

from __future__ import annotations

import torch

import elixir_tune
from elixir_tune.plan import validate
from elixir_tune.plan.schema import ContextParallel
from tests.distributed.engine_plans import batches, make_plan, param_groups, tiny_gpt2, tiny_llama_gqa
from tests.distributed.engine_tp_worker import _split_rows
from tests.distributed.engine_worker import compare, local_micro, mean_over_ranks, plain_training

SEQ = 16
MICRO = 2
STEPS = 4
BLOCK_LISTS = {"gpt2": "transformer.h", "llama": "model.layers"}


def tiny_mistral() -> torch.nn.Module:
    """Mistral (not in the zoo): its sliding window of 4 tokens on every layer, shorter than the 16."""
    from transformers import MistralConfig, MistralForCausalLM

    from tests.zoo.models import DECODER

    torch.manual_seed(0)
    config = MistralConfig(
        **DECODER, intermediate_size=64, num_key_value_heads=2, sliding_window=4, attention_dropout=0.0
    )
    return MistralForCausalLM(config).train()


def build(case: dict):
    if case["model"] == "mistral":
        model = tiny_mistral()
    elif case["model"].startswith("zoo:"):
        from tests.zoo.models import build as build_zoo

        model = build_zoo(case["model"].removeprefix("zoo:"))
    else:
        model = tiny_gpt2() if case["model"] == "gpt2" else tiny_llama_gqa()
    model.config._attn_implementation = case.get("attn", "sdpa")
    if case.get("lora"):
        from elixir_tune.models.lora import apply_lora

        model = apply_lora(model, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    return model, opt


def padded(global_batches: list[dict]) -> list[dict]:
    """Right padding: each row keeps 3 to SEQ real tokens; padded positions have attention_mask 0,
    token 0 and label -100, so rows count different tokens."""
    generator = torch.Generator().manual_seed(5)
    out = []
    for batch in global_batches:
        rows = batch["input_ids"].shape[0]
        lengths = torch.randint(3, SEQ + 1, (rows,), generator=generator)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        ids = batch["input_ids"] * mask
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    degree, accum, tensor, stages = case["context"], case.get("accum", 1), case.get("tensor", 1), case.get("stages", 1)
    model, opt = build(case)
    plan = make_plan(
        model,
        world,
        case.get("chunk_size", 4096),
        cache=case.get("cache", "all"),
        offload=case.get("offload", 0.0),
        block_list=("base_model.model." if case.get("lora") else "")
        + BLOCK_LISTS.get(case["model"].removeprefix("zoo:"), "model.layers"),
        micro_batch_size=MICRO,
        grad_accum_steps=accum,
        seq_len=SEQ,
        checkpoint_every=case.get("checkpoint", 0),
        frozen_chunks=bool(case.get("lora")),
        tensor=tensor,
        stages=stages,
    )
    plan.parallel.context = ContextParallel(degree=degree, mode=case.get("mode", "ulysses"))
    plan.training.global_batch_size = MICRO * accum * (world // (degree * tensor * stages))
    assert not validate(plan), validate(plan)
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    data, data_rank = elixir_tune.data_size(), elixir_tune.data_rank()
    global_batches = batches(STEPS, plan.training.global_batch_size, SEQ, seed=index + 1)
    if case.get("padded"):
        global_batches = padded(global_batches)
    if case.get("packed"):  # two documents in each row: refused, not computed with the wrong masks
        batch = dict(global_batches[0], position_ids=torch.arange(SEQ).remainder(SEQ // 2).expand(MICRO, SEQ))
        try:
            model(**local_micro(batch, data_rank, data, 1, 0))
        except ValueError as error:
            return {"case": case, "packed_error": str(error)}
        return {"case": case, "packed_error": None}
    if case.get("slice_by_rank"):
        from elixir_tune.errors import ContractError

        try:
            model(**local_micro(global_batches[0], rank, world, 1, 0))
        except ContractError as error:
            return {"case": case, "contract_error": str(error)}
        return {"case": case, "contract_error": None}
    losses, logits_len = [], 0
    for batch in global_batches:
        micro = [local_micro(batch, data_rank, data, accum, k) for k in range(accum)]
        if case.get("loop") == "plain":
            share = 0.0
            for micro_batch in micro:
                output = model(**micro_batch)
                logits_len = output.logits.shape[1]
                opt.backward(output.loss / accum)
                share += float(output.loss.detach()) / accum
        else:
            share = float(model.forward_backward(micro))
        opt.step()
        opt.zero_grad()
        losses.append(share)
    state = model.state_dict()  # gathered on rank 0
    world_losses = mean_over_ranks(losses, world)
    result = {"case": case, "data": data, "data_rank": data_rank, "logits_len": logits_len}
    if rank != 0:
        return result
    # Plain PyTorch on each step's whole global batch, every sequence whole.
    reference = plain_training(*build(case), global_batches)
    ours = {"state": {name: value.tolist() for name, value in state.items()}, "norms": []}
    result = dict(result, **compare(ours, reference, world_losses), world_losses=world_losses)
    if case.get("control") == "attention":
        # The control: plain PyTorch with the other attention implementation (eager for sdpa), the same
        # mathematics in another fp32 order, as ring attention's blockwise softmax is.
        other = "eager" if case.get("attn", "sdpa") == "sdpa" else "sdpa"
        control = plain_training(*build(dict(case, attn=other)), global_batches)
        result["control_weight_abs"] = compare(control, reference, control["losses"])["weight_abs"]
    elif case.get("control"):
        # The control: plain PyTorch with the row-parallel products summed over two halves of their
        # input, as tensor 2 sums them: the fp32 reordering error of this case without the engine.
        control_model, control_opt = build(case)
        for name, module in control_model.named_modules():
            if name.endswith(("o_proj", "down_proj")):
                module.register_forward_hook(_split_rows)
        control = plain_training(control_model, control_opt, global_batches)
        result["control_weight_abs"] = compare(control, reference, control["losses"])["weight_abs"]
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
