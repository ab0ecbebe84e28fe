"""Worker for test_pipeline_export.py: ``save_pretrained`` and the recipes' evaluation under pipeline plans.

Each case is a dict: ``family`` (tests/unit/models/stage_families.py, 3 blocks), ``stages``, ``tensor``,
``assignment`` and ``schedule`` (default modular, looped_bfs), ``steps``, ``max_shard_size`` and ``dtype`` (``save_pretrained``'s; dtype a torch dtype's name or absent).
The world is data x stages x tensor. Every rank trains ``steps`` steps through ``forward_backward`` (each data
rank its own micro-batches; the split evaluated once after the first step), writes the model with
``elixir_tune.save_pretrained`` and evaluates the eval split with ``recipes.evaluation.evaluate``. Rank 0 then reports:

* ``saved``: what the files hold (names, dtypes), read with safetensors, against what plain transformers'
  ``save_pretrained`` of the same model writes; the largest difference of every tensor loaded back with
  ``AutoModelForCausalLM.from_pretrained`` from the engine's merged ``model.state_dict()`` (cast to the
  stored dtype) and from plain PyTorch trained on the same global batches;
* ``eval``: the engine's evaluation loss and token count, and plain PyTorch's on the same split (the
  token-weighted mean of the loaded model's batch losses).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

import elixir_tune
from elixir_tune.recipes.evaluation import evaluate, predicted_tokens
from tests.distributed.engine_plans import make_plan
from tests.distributed.engine_worker import plain_training
from tests.distributed.torch_reference import MICRO, SEQ, build_stage_family, stage_family_batches

ACCUM = 4


def eval_split() -> list[dict[str, torch.Tensor]]:
    """Seven batches, the last with one row (row padding), one without loss tokens (weight 0), one shorter
    and one with a padding mask: on 2 data ranks, rank 1 runs a stand-in batch in its fourth round."""
    from tests.unit.models.stage_families import VOCAB

    generator = torch.Generator().manual_seed(7)
    split = []
    for index, (rows, length) in enumerate([(2, SEQ), (2, SEQ), (2, 6), (2, SEQ), (2, SEQ), (2, SEQ), (1, SEQ)]):
        ids = torch.randint(5, VOCAB, (rows, length), generator=generator)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if index == 1:
            batch["labels"][:] = -100  # no loss tokens: its mean loss is NaN, it counts nothing
        if index == 3:
            batch["attention_mask"] = torch.ones_like(ids)
            batch["attention_mask"][0, -3:] = 0
            batch["labels"][0, -3:] = -100
        split.append(batch)
    return split


def plain_eval(model, split: list[dict[str, torch.Tensor]]) -> tuple[float, int]:
    """Plain PyTorch's token-weighted mean loss over the split and its token count."""
    total, tokens = 0.0, 0
    model.eval()
    with torch.no_grad():
        for batch in split:
            count = predicted_tokens(batch)
            if count:
                total += float(model(**batch).loss) * count
                tokens += count
    return total / tokens, tokens


def saved_tensors(directory: Path) -> dict[str, str]:
    """Name -> safetensors dtype of every tensor in the directory's files."""
    from safetensors import safe_open

    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118  (safe_open has no __iter__)
                found[name] = str(handle.get_slice(name).get_dtype())
    return found


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    from transformers import AutoModelForCausalLM

    from elixir_tune.models.stage_plans import resolve_stage_plan
    from elixir_tune.profiler.source import quiet_transformers

    stages, tensor = case["stages"], case.get("tensor", 1)
    data = world // (stages * tensor)
    out = Path(out_path).parent / f"saved-{index}"
    dtype = getattr(torch, case["dtype"]) if case.get("dtype") else None
    start = time.perf_counter()
    with quiet_transformers():
        model, opt = build_stage_family(case["family"])
        stage_plan = resolve_stage_plan(model)
        assert not isinstance(stage_plan, str), stage_plan
        plan = make_plan(
            model, world, 4096, block_list=stage_plan.block_list, micro_batch_size=MICRO, grad_accum_steps=ACCUM,
            seq_len=SEQ, stages=stages, tensor=tensor, assignment=case.get("assignment", "modular"),
            schedule=case.get("schedule", "looped_bfs"),
        )  # fmt: skip
        model, opt = elixir_tune.setup(model, opt, plan=plan)
        steps = stage_family_batches(case["steps"], data)
        split = eval_split()
        for step, per_rank in enumerate(steps):
            if step == 1:  # an evaluation between steps: the steps after it train as if it had not run
                evaluate(model, split, elixir_tune.data_rank(), elixir_tune.data_size(), torch.device("cpu"))
            model.forward_backward(per_rank[elixir_tune.data_rank()])
            opt.step()
            opt.zero_grad()
        elixir_tune.save_pretrained(model, out, max_shard_size=case.get("max_shard_size", "5GB"), dtype=dtype)
        result = evaluate(model, split, elixir_tune.data_rank(), elixir_tune.data_size(), torch.device("cpu"))
        state = model.state_dict()  # merged on rank 0 (a collective)
    report: dict = {"case": case, "eval": {"loss": result.loss, "tokens": result.tokens}}
    report["engine_s"] = time.perf_counter() - start
    if rank != 0:
        return report
    with quiet_transformers():
        loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
        reference, reference_opt = build_stage_family(case["family"])
        keys = ("input_ids", "labels")
        whole = [{key: torch.cat([b[key] for micro in per_rank for b in micro]) for key in keys} for per_rank in steps]
        plain_training(reference, reference_opt, whole)
        plain_dir = Path(out_path).parent / f"plain-{index}"
        reference.save_pretrained(plain_dir, safe_serialization=True)
        stored = dtype or torch.float32
        reference_state = reference.state_dict()
        report["saved"] = {
            "tensors": saved_tensors(out),
            "plain_tensors": {name: kind for name, kind in saved_tensors(plain_dir).items()},
            "files": sorted(path.name for path in out.iterdir()),
            "index_files": sorted(
                set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
            )
            if (out / "model.safetensors.index.json").exists()
            else [],
            "missing": sorted(set(state) - set(loaded)),
            "engine_diff": max(float((loaded[k].float() - v.to(stored).float()).abs().max()) for k, v in state.items()),
            "plain_diff": max(float((loaded[k].float() - reference_state[k].float()).abs().max()) for k in state),
            "loaded_dtypes": sorted({str(value.dtype) for value in loaded.values()}),
        }
        # The evaluation's reference: plain PyTorch on the weights written (fp32 cases), on the same split.
        eval_model = AutoModelForCausalLM.from_pretrained(out) if dtype is None else reference
        report["eval"]["plain_loss"], report["eval"]["plain_tokens"] = plain_eval(eval_model, split)
    report["case_s"] = time.perf_counter() - start
    return report


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
