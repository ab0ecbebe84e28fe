"""Worker for the tensor-parallel weights-in / weights-out test: a fine-tune from a Hugging Face directory.

Run by ``engine_launch.py`` on 2 ranks (gloo, CPU) with one case:

    weights: a Hugging Face directory of a tiny Llama written by transformers (the test writes it)
    out: a directory both ranks can write (checkpoints, save_pretrained)

On a tensor-2 plan at world 2, the model built on the meta device:

1. ``setup(..., weights=DIR)`` reads each rank's pieces: the engine's full weights equal the file's;
2. 2 AdamW steps, ``save_checkpoint`` (each rank its pieces' shards and optimizer state), 2 more steps,
   ``save_pretrained``, which plain ``transformers`` reads back (rank 0) equal to the engine's weights;
3. a fresh model resumed from the checkpoint runs the same 2 steps: losses and weights bitwise equal;
4. a data-parallel plan (data 2) resumed from the tensor-parallel checkpoint: weights only, a warning,
   the weights equal those the checkpoint saved.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import elixir_tune
from elixir_tune.engine.comm import is_dtensor
from tests.distributed.engine_plans import batches, make_plan, param_groups
from tests.distributed.engine_worker import local_micro

SEQ = 8
STEPS = 4  # the checkpoint is saved after SAVE_AT of them
SAVE_AT = 2


def build(weights: str, tensor: int, world: int):
    """A meta-device Llama of the directory's config, its plan, and the engine over it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(weights)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    plan = make_plan(
        model, world, 2048, cache="min", tensor=tensor, block_list="model.layers", micro_batch_size=2, seq_len=SEQ
    )
    return elixir_tune.setup(model, optimizer, plan=plan, weights=weights)


def train(model, optimizer, steps: list[dict], data_rank: int, data: int) -> list[float]:
    losses = []
    for batch in steps:
        loss = model(**local_micro(batch, data_rank, data, 1, 0)).loss
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def file_weights(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (or that only one side has)."""
    return sorted(set(a) ^ set(b)) + sorted(k for k in set(a) & set(b) if not torch.equal(a[k].float(), b[k].float()))


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    weights, out = case["weights"], Path(case["out"])
    steps = batches(STEPS, 2, SEQ)  # the tensor group shares every micro-batch (data degree 1)
    result: dict = {}

    # 1. From the Hugging Face directory, each rank its pieces.
    model, optimizer = build(weights, 2, world)
    params = dict(model.module.named_parameters())
    result["split"] = sorted(n for n, p in params.items() if is_dtensor(p) and p._local_tensor.shape != p.shape)
    result["meta_left"] = sorted(n for n, p in params.items() if p.is_meta)
    start = model.state_dict()
    if rank == 0:
        result["start_differs"] = same(start, file_weights(weights))

    # 2. Train, checkpoint half-way, train on, save_pretrained.
    losses = train(model, optimizer, steps[:SAVE_AT], 0, 1)
    at_save = model.state_dict(all_ranks=True)
    directory = elixir_tune.save_checkpoint(out / "ckpt", model, optimizer, SAVE_AT)
    result["rank_files"] = sorted(p.name for p in directory.glob("rank-*.pt"))
    losses += train(model, optimizer, steps[SAVE_AT:], 0, 1)
    final = model.state_dict()
    elixir_tune.save_pretrained(model, out / "pretrained")
    if rank == 0:
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_pretrained(out / "pretrained", dtype=torch.float32)
        result["pretrained_differs"] = same(plain.state_dict(), final)
        result["pretrained_keys"] = len(plain.state_dict())

    # 3. Resume exactly: the same last steps, bitwise.
    model, optimizer = build(weights, 2, world)
    meta = elixir_tune.load_checkpoint(out / "ckpt", model, optimizer)
    result["resume_exact"] = meta["exact"]
    resumed_losses = train(model, optimizer, steps[SAVE_AT:], 0, 1)
    result["resumed_losses_equal"] = resumed_losses == losses[SAVE_AT:]
    resumed = model.state_dict()
    if rank == 0:
        result["resumed_differs"] = same(resumed, final)

    # 4. Into a data-parallel plan: the weights only, with a warning.
    model, optimizer = build(weights, 1, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = elixir_tune.load_checkpoint(out / "ckpt", model, optimizer)
    result["dp_exact"] = meta["exact"]
    result["dp_warnings"] = [str(w.message) for w in caught if "checkpoint" in str(w.message)]
    result["dp_differs"] = same(model.state_dict(all_ranks=True), at_save)
    result["losses"] = losses
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
