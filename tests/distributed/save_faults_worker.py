"""Worker for test_save_faults.py: rank 0 fails for real while writing, and every rank must say so.

Run by ``engine_launch.py`` (argv: cases.json, output prefix). Each case is a dict:

* ``save``: ``"pretrained"`` (``elixir_tune.save_pretrained``), ``"checkpoint"`` (``save_checkpoint``),
  ``"recipe_adapter"`` (the finetune recipe's ``write_usable_dir`` of a LoRA model: PEFT's files, written by
  rank 0 alone after the last collective, on a tiny Llama), or ``"adapter"`` / ``"merged"`` (a user's script
  calling ``lora.save_adapter`` / ``lora.save_merged`` on that LoRA model);
* ``stages``: 1 (a data-parallel plan on every rank) or 2 (a pipeline of 2 stages);
* ``harm``: what makes rank 0's write fail: ``"file_too_large"`` (a file size limit of a few KiB on rank 0
  alone, ``RLIMIT_FSIZE``: the kernel answers EFBIG mid-file, as a full disk answers ENOSPC), or
  ``"not_a_directory"`` (the target's parent is a regular file: ENOTDIR), or ``"user_files"`` (the target is a
  folder holding a file of the user's, which the recipe's export refuses to overwrite).

Every rank sets up the tiny GPT-2 of tests/unit/models/stage_families.py (hidden 32, 3 blocks), trains
one step, saves a good copy, trains another step and saves again into the same place with the harm in force.
Each rank reports the error it got (type and text), how long the failed save took, whether the
ranks are still in step afterwards (a collective with a timeout of its own), and rank 0 the sha256
of every file under the target before and after the failed save.
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

import elixir_tune
from tests.distributed.engine_plans import make_plan
from tests.distributed.torch_reference import MICRO, SEQ, build_stage_family, stage_family_batches

ACCUM = 2
LORA_OPTIONS = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_targets=["q_proj", "v_proj"])
SIZE_LIMIT_BYTES = 4096  # rank 0's file size limit under "file_too_large": each save writes more than that


def _tree_hashes(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root`` (the lock file's holder text left out)."""
    if not root.is_dir():
        return {}
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != ".lock"
    }


def _save(case: dict, model, opt, target: Path, step: int) -> None:
    if case["save"] == "pretrained":
        elixir_tune.save_pretrained(model, target, max_shard_size=case.get("max_shard_size", "5GB"))
    elif case["save"] == "adapter":
        from elixir_tune.models.lora import save_adapter

        save_adapter(model, target)
    elif case["save"] == "merged":
        from elixir_tune.models.lora import save_merged

        save_merged(model, target)
    elif case["save"] == "recipe_adapter":  # the finetune recipe's --save-pretrained with --lora-rank
        from elixir_tune.recipes.finetune import write_usable_dir

        options = dict(save_pretrained=str(target), max_shard_size="5GB", merge_lora=False, model=None, **LORA_OPTIONS)
        write_usable_dir(model, target.parent, argparse.Namespace(**options), dist.get_rank())
    else:
        elixir_tune.save_checkpoint(target, model, opt, step=step)


def _train_step(model, opt, batches: list[dict]) -> None:
    model.forward_backward(batches)
    opt.step()
    opt.zero_grad()


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    from elixir_tune.models.stage_plans import resolve_stage_plan
    from elixir_tune.profiler.source import quiet_transformers

    stages = case.get("stages", 1)
    data = world // stages
    base = Path(out_path).parent / f"case-{index}"
    good = base / "out"  # the first save's place; the failed save goes there too, unless the harm says otherwise
    lora = case["save"] in ("recipe_adapter", "adapter", "merged")
    with quiet_transformers():
        model, opt = build_stage_family("llama" if lora else "gpt2")
        if lora:
            from elixir_tune.models.lora import apply_lora

            model = apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=LORA_OPTIONS["lora_targets"])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        stage_plan = resolve_stage_plan(model)
        assert not isinstance(stage_plan, str), stage_plan
        plan = make_plan(
            model, world, 4096, block_list=stage_plan.block_list, micro_batch_size=MICRO, grad_accum_steps=ACCUM,
            seq_len=SEQ, stages=stages, frozen_chunks=lora,
        )  # fmt: skip
        model, opt = elixir_tune.setup(model, opt, plan=plan)
    steps = stage_family_batches(2, data)
    _train_step(model, opt, steps[0][elixir_tune.data_rank()][:ACCUM])
    _save(case, model, opt, good, 1)
    before = _tree_hashes(good) if rank == 0 else {}
    _train_step(model, opt, steps[1][elixir_tune.data_rank()][:ACCUM])

    target = good
    if case["harm"] == "user_files":  # a folder of the user's: the export must not overwrite their config.json
        target = base / "theirs"
        if rank == 0:
            target.mkdir(parents=True)
            (target / "config.json").write_text('{"mine": true}\n')
        dist.barrier()
    if case["harm"] == "not_a_directory":
        blocker = base / "a-file"
        if rank == 0:
            blocker.write_text("a regular file where a directory must go\n")
        dist.barrier()
        target = blocker / "out"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    error, started = "", time.perf_counter()
    try:
        if case["harm"] == "file_too_large" and rank == 0:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write returns EFBIG instead of killing the process
            resource.setrlimit(resource.RLIMIT_FSIZE, (SIZE_LIMIT_BYTES, hard))
        _save(case, model, opt, target, 2)
    except Exception as failure:  # noqa: BLE001  (the test asserts the type and text)
        error = f"{type(failure).__name__}: {failure}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    save_s = time.perf_counter() - started
    # The ranks are still in step: the next collectives (the full weights gathered to rank 0) work.
    state = model.state_dict()
    report = {
        "base": str(base),
        "error": error,
        "save_s": save_s,
        "in_step": rank != 0 or all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point()),
    }
    after = _tree_hashes(good) if rank == 0 else {}
    if case["harm"] == "user_files" and rank == 0:
        report["theirs"] = {path.name: path.read_text() for path in (base / "theirs").iterdir()}
    leftovers = sorted(str(p.relative_to(base)) for p in base.rglob("*") if ".tmp" in p.name) if rank == 0 else []
    # The same save with the harm gone succeeds, in place of the previous one.
    _save(case, model, opt, good, 3)
    if rank == 0:
        report.update(before=before, after=after, leftovers=leftovers, retried=_tree_hashes(good))
        report["retry_leftovers"] = sorted(str(p.relative_to(base)) for p in base.rglob("*") if ".tmp" in p.name)
    return report


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
