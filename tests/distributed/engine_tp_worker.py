"""Worker for the tensor-parallel tests: the engine with tensor parallelism against plain PyTorch.

Run by ``engine_launch.py`` as N processes (gloo, CPU). Each case is a dict:

    model: llama (grouped-query attention) | gpt2 | zoo:NAME (a zoo model, tests/zoo/models.py, with
        its batches)      tensor: tensor degree T (world = data x T)
    mode: 1d | 2d      sp: sequence parallelism (1d)    chunk_size, cache, offload (fraction)
    attn: the attention implementation (default sdpa; eager builds a per-sample mask)
    vocab_loss: the logits stay split by vocabulary, the loss runs under loss_parallel
    meta: the model is built on the meta device and initialized by setup (seed META_SEED); the
        reference gets the same initializer's values
    checkpoint (every), accum, clip (max norm or 0), steps

Every rank of a tensor group takes the same micro-batches (those of its data-parallel rank); rank 0
also trains plain PyTorch on each step's whole global batch and reports the largest differences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import elixir_tune
from elixir_tune.engine.io.initializer import Initializer
from elixir_tune.engine.io.materialize import InitSource, materialize_replicated
from elixir_tune.engine.parallel.tensor_parallel import local_data
from elixir_tune.plan.tensor_layout import local_shape
from tests.distributed.engine_plans import batches, make_plan, tiny_gpt2, tiny_llama_gqa
from tests.distributed.engine_worker import compare, local_micro, mean_over_ranks, plain_accumulated_training
from tests.distributed.torch_reference import adamw, state_round_trip

SEQ = 8


META_SEED = 7


def build(case: dict, materialize: bool = False):
    """The case's model and optimizer; ``meta`` cases build it on the meta device (``materialize``:
    then give it the initializer's values for META_SEED, what setup(seed=META_SEED) makes)."""
    if case["model"].startswith("zoo:"):
        from tests.zoo.models import build as build_zoo

        model = build_zoo(case["model"].removeprefix("zoo:"))
    elif case.get("meta"):
        with torch.device("meta"):
            model = tiny_llama_gqa() if case["model"] == "llama" else tiny_gpt2()
        if materialize:
            materialize_replicated(model, set(), InitSource(Initializer(model, META_SEED)))
    else:
        model = tiny_llama_gqa() if case["model"] == "llama" else tiny_gpt2()
    if case.get("attn"):
        model.config._attn_implementation = case["attn"]  # eager: a per-sample causal mask
    return model, adamw(model)


def block_list(case: dict) -> str:
    if case["model"].startswith("zoo:"):
        from elixir_tune.profiler.blocks import find_block_list

        return find_block_list(build(case)[0])[0]
    return "model.layers" if case["model"] == "llama" else "transformer.h"


def global_batches(case: dict, data: int) -> list[dict]:
    size = case.get("micro", 2) * case.get("accum", 1) * data
    if case["model"].startswith("zoo:"):
        from tests.zoo.models import global_batches as zoo_batches

        return zoo_batches(case["model"].removeprefix("zoo:"), case.get("steps", 10), size)
    return batches(case.get("steps", 10), size, SEQ)


def run_engine(case: dict, rank: int, world: int) -> dict:
    tensor = case["tensor"]
    data, data_rank = world // tensor, rank // tensor  # rank = data_index * T + tensor_index (P = 1)
    model, opt = build(case)
    plan = make_plan(
        model,
        world,
        case["chunk_size"],
        tensor=tensor,
        tensor_mode=case.get("mode", "1d"),
        sequence_parallel=case.get("sp", True),
        cache=case.get("cache", "all"),
        offload=case.get("offload", 0.0),
        checkpoint_every=case.get("checkpoint", 0),
        block_list=block_list(case),
        micro_batch_size=case.get("micro", 2),
        grad_accum_steps=case.get("accum", 1),
        seq_len=SEQ,
    )
    model, opt = elixir_tune.setup(
        model, opt, plan=plan, seed=META_SEED, vocab_parallel_loss=case.get("vocab_loss", False)
    )
    # The engine's local pieces have the shapes the search packs (plan/tensor_layout.py).
    model_type, mode = plan.model.model_type, plan.parallel.tensor.mode
    mismatches = [
        (name, list(local_data(p).shape))
        for name, p in model.module.named_parameters()
        if list(local_data(p).shape)
        != local_shape(name, list(p.shape), model_type, tensor, mode, plan.model.tensor_layout)
    ]
    accum = case.get("accum", 1)
    losses, norms = [], []
    for batch in global_batches(case, data):
        total = 0.0
        for k in range(accum):
            output = model(**local_micro(batch, data_rank, data, accum, k))
            logits_vocab = local_data(output.logits).shape[-1]  # this rank's vocabulary columns
            loss = output.loss / accum
            opt.backward(loss)
            total += float(loss.detach())
        if case.get("clip"):
            norms.append(float(opt.clip_grad_norm(case["clip"])))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    full = model.state_dict()  # a collective: every rank calls it
    # Loading full weights slices them per tensor rank again: a round trip changes nothing.
    round_trip = state_round_trip(model)
    return {
        "losses": losses,
        "norms": norms,
        "state": {k: v.tolist() for k, v in full.items()} if rank == 0 else None,
        "chunks": len(plan.memory.chunks),
        "offloaded": sum(c.offload for c in plan.memory.chunks),
        "chunk_numel": sum(c.numel for c in plan.memory.chunks),
        "report": model.memory_report(),
        "layout_mismatches": mismatches,
        "round_trip": round_trip,
        "logits_vocab": logits_vocab,
    }


def _split_rows(module, inputs, output):
    """A row-parallel linear's product summed over two halves of its input, as tensor 2 sums it."""
    x, half = inputs[0], inputs[0].shape[-1] // 2
    return F.linear(x[..., :half], module.weight[:, :half]) + F.linear(x[..., half:], module.weight[:, half:])


def run_reference(case: dict, data: int, halves: int = 1, split_rows: bool = False) -> dict:
    """Plain PyTorch on each step's whole global batch. The control (``halves``, ``split_rows``)
    computes the same function in another summation order, the ones tensor x data parallelism uses:
    the global batch as ``halves`` parts whose gradients add up, the row-parallel products (o_proj,
    down_proj) as two halves of their input dimension."""
    model, opt = build(case, materialize=True)
    if split_rows:
        for name, module in model.named_modules():
            if name.endswith(("o_proj", "down_proj")):
                module.register_forward_hook(_split_rows)
    return plain_accumulated_training(model, opt, global_batches(case, data), halves, case.get("clip", 0.0))


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    """One case on this rank; rank 0 also runs the plain-PyTorch reference and compares."""
    engine = run_engine(case, rank, world)
    # Every tensor rank of a data group reports the same loss: the world mean is the data mean.
    world_losses = mean_over_ranks(engine["losses"], world)
    result = {
        "case": case,
        "world_losses": world_losses,
        "losses": engine["losses"],
        "chunks": engine["chunks"],
        "offloaded": engine["offloaded"],
        "chunk_numel": engine["chunk_numel"],
        "report": engine["report"],
        "layout_mismatches": engine["layout_mismatches"],
        "round_trip": engine["round_trip"],
        "logits_vocab": engine["logits_vocab"],
    }
    if rank == 0:
        reference = run_reference(case, world // case["tensor"])
        result.update(compare(engine, reference, world_losses))
        result["ref_losses"] = reference["losses"]
        if case.get("control"):  # plain PyTorch against itself, reordered: the fp32 floor for this case
            controls = [
                run_reference(case, world // case["tensor"], halves, rows) for halves, rows in ((2, False), (2, True))
            ]
            result["control_weight_abs"] = max(compare(c, reference, c["losses"])["weight_abs"] for c in controls)
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
