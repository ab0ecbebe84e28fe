"""Worker for test_lora_mesh.py: LoRA on pipeline stages of tensor pieces, and packed rows on pipeline stages.

Each case trains a tiny causal LM of one family (tests/unit/models/stage_families.py: hidden 32, 3 blocks, so
that on 2 stages the modular split is uneven) with ``forward_backward(..., weight_by_tokens=True)``, as the
fine-tuning recipe does, and rank 0 trains the same model in plain transformers (with PEFT for LoRA) on each
micro-batch unpadded, every micro-batch's mean loss weighted by its share of the step's counted tokens.

Case keys: ``family``, ``stages``, ``tensor`` (1d), ``sequence_parallel``, ``offload`` (share of chunks on
the host), ``lora`` (adapters on q, v and down projections, the base in frozen chunks), ``batches``:

* ``plain``: ``SEQ`` tokens, no mask;
* ``padded``: micro-batches of lengths 7 and 5, the second row of each padded over its last 2 tokens
  (the pipeline pads each to the step's longest);
* ``packed``: rows of several samples (``elixir_tune.data.packing.packed_rows``: ``position_ids``
  restarting at each sample, no ``attention_mask``), micro-batches of lengths 16 and 12, so the
  pipeline pads the second with a tail of its own positions; the model's matrices are scaled
  (``PACKED_WEIGHT_SCALE``) so that attention across samples would show in the loss. Rank 0 also reports
  the first step's loss of the same rows without their ``position_ids`` (the samples then see each other):
  what a pipeline that dropped them would compute.

``resume``: after the first step the run saves a checkpoint, trains on, loads it and repeats the later steps:
the losses and the final weights must be bitwise those of the first pass. Kinds of ``lora_worker.py``
(``parallel``, ``weights``) run as there.
"""

from __future__ import annotations

import math

import torch

import elixir_tune
from elixir_tune.data.packing import packed_rows
from tests.distributed import lora_worker
from tests.distributed.engine_plans import make_plan
from tests.distributed.engine_worker import mean_over_ranks
from tests.distributed.torch_reference import MICRO, SEQ, adamw, build_stage_family, step_batches, token_micro

STEPS = 2
ACCUM = 2  # torch_reference's MICRO rows of SEQ tokens per micro-batch, fewer of them per step
PADDED_LENGTHS = (7, 5)
PACKED_LENGTHS = (16, 12)
# Packed cases scale the models' matrices by this: at the builders' small initial weights attention is near
# uniform and a row's samples seeing each other moves a step's loss by ~1e-5 only; scaled, by ~1e-2.
PACKED_WEIGHT_SCALE = 5.0
TARGETS = ["q_proj", "v_proj", "down_proj"]


def build(case: dict):
    """The family's model (seeded: every rank and the reference alike), with LoRA adapters when asked; its
    AdamW over the trained parameters."""
    from elixir_tune.models.lora import apply_lora

    model, _ = build_stage_family(case["family"])
    if case.get("batches") == "packed":
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 2:
                    param.mul_(PACKED_WEIGHT_SCALE)
    if case.get("lora"):
        model = apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=TARGETS)
        torch.manual_seed(1)
        with torch.no_grad():  # PEFT starts lora_B at zero; a random start trains both matrices from step one
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.normal_(0.0, 0.05)
    return model, adamw(model)


def packed_micro(generator: torch.Generator, length: int, vocab: int) -> dict:
    """MICRO packed rows of ``length`` tokens: samples of 2 to 6 tokens until the row is full or a few short."""
    rows = []
    for _ in range(MICRO):
        samples, used = [], 0
        while used < length - 1:
            size = min(int(torch.randint(2, 7, (1,), generator=generator)), length - used)
            ids = torch.randint(5, vocab, (size,), generator=generator).tolist()
            samples.append((ids, ids))
            used += size
        rows.append(samples)
    return packed_rows(rows, length, pad_id=0)


def batches(case: dict, data: int) -> list[list[list[dict]]]:
    """Each step's micro-batches of each data rank, ``[step][data_rank][micro]`` (seeded: the same everywhere)."""
    from tests.unit.models.stage_families import VOCAB

    kind = case.get("batches", "plain")

    def micro(generator: torch.Generator, k: int) -> dict:
        if kind == "packed":
            return packed_micro(generator, PACKED_LENGTHS[k], VOCAB)
        return token_micro(generator, PADDED_LENGTHS[k] if kind == "padded" else SEQ, padded=kind == "padded")

    return step_batches(STEPS, data, ACCUM, 2, micro)


def reference(case: dict, steps: list[list[list[dict]]], drop: tuple[str, ...] = ()) -> dict:
    """Plain transformers (and PEFT) on each step's micro-batches of every data rank, one by one and unpadded,
    each mean loss times its share of the step's counted tokens (``drop``: keys left out of the batches)."""
    model, opt = build(case)
    losses = []
    for per_rank in steps:
        micro = [{k: v for k, v in batch.items() if k not in drop} for batches_ in per_rank for batch in batches_]
        counts = [int((batch["labels"][:, 1:] != -100).sum()) for batch in micro]
        total = 0.0
        for batch, count in zip(micro, counts, strict=True):
            loss = model(**batch).loss * (count / sum(counts))
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "state": model.state_dict()}


def run_family(case: dict, rank: int, world: int, out_path: str) -> dict:
    from elixir_tune.models.stage_plans import resolve_stage_plan
    from elixir_tune.plan.tensor_layout import local_shape
    from elixir_tune.profiler.source import quiet_transformers

    stages, tensor = case["stages"], case.get("tensor", 1)
    data = world // (stages * tensor)
    with quiet_transformers():
        model, opt = build(case)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    stage_plan = resolve_stage_plan(model)
    assert not isinstance(stage_plan, str), stage_plan
    plan = make_plan(
        model, world, 4096, block_list=stage_plan.block_list, micro_batch_size=MICRO, grad_accum_steps=ACCUM,
        seq_len=max(PACKED_LENGTHS), stages=stages, tensor=tensor, offload=case.get("offload", 0.0),
        sequence_parallel=case.get("sequence_parallel", True), frozen_chunks=bool(case.get("lora")),
    )  # fmt: skip
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    engine = model.engine
    steps = batches(case, data)

    def train(step_batches: list[list[list[dict]]]) -> list[float]:
        losses = []
        for per_rank in step_batches:
            losses.append(float(model.forward_backward(per_rank[elixir_tune.data_rank()], weight_by_tokens=True)))
            opt.step()
            opt.zero_grad()
        return losses

    checkpoint = f"{out_path}.case{case['index']}.checkpoint"
    losses = train(steps[:1])
    if case.get("resume"):
        elixir_tune.save_checkpoint(checkpoint, model, opt, step=1)
    losses += train(steps[1:])
    state = model.state_dict()
    result: dict = {"losses": mean_over_ranks(losses, world)}  # the mean over data ranks: the step's loss
    if case.get("resume"):
        elixir_tune.load_checkpoint(checkpoint, model, opt)
        result["resumed_losses"] = mean_over_ranks(train(steps[1:]), world)
        resumed = model.state_dict()
        result["resumed_equal"] = rank != 0 or all(torch.equal(resumed[k], v) for k, v in state.items())
        ids = steps[0][0][0]["input_ids"]
        try:  # position ids that are not one per token: refused on every rank alike, before any stage runs
            model.forward_backward([{"input_ids": ids, "labels": ids, "position_ids": ids[:, 1:]}])
        except ValueError as error:
            result["bad_positions_error"] = str(error)
    frozen_slots = [slot for chunk in engine.chunks if chunk.frozen for slot in chunk.slots]
    table = plan.model.tensor_layout
    result.update(
        frozen_chunks=sum(chunk.frozen for chunk in engine.chunks),
        frozen_shard_bytes=sum(c.shard_bytes() + c.optimizer_state_bytes for c in engine.chunks if c.frozen),
        frozen_shard_numel=sum(c.shard_numel for c in engine.chunks if c.frozen),
        # Each frozen slot holds this rank's tensor piece: the table's local shape.
        frozen_local=all(
            slot.numel
            == math.prod(local_shape(slot.name, list(slot.param.shape), plan.model.model_type, tensor, "1d", table))
            for slot in frozen_slots
        ),
    )
    if rank != 0:
        return result
    with quiet_transformers():
        plain = reference(case, steps)
        if case.get("batches") == "packed":  # the rows without their position ids: what a dropped key gives
            result["leaky_losses"] = reference(case, steps[:1], drop=("position_ids",))["losses"]
    trained = [name for name in initial if ".lora_" in name]
    result.update(
        reference_losses=plain["losses"],
        loss_rel=max(abs(a - b) / abs(b) for a, b in zip(result["losses"], plain["losses"], strict=True)),
        weight_abs=max(float((state[k] - v).abs().max()) for k, v in plain["state"].items()),
        same_names=sorted(state) == sorted(plain["state"]),
        adapters=len(trained),
        adapters_moved=min((float((plain["state"][n] - initial[n]).abs().max()) for n in trained), default=0.0),
        base_unchanged=all(torch.equal(state[n], initial[n]) for n in initial if n not in trained),
    )
    return result


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    if case.get("kind", "family") != "family":
        return lora_worker.run_case(case, index, rank, world, out_path)
    return run_family(dict(case, index=index), rank, world, out_path)


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
