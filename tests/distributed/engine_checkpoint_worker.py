"""Worker for test_engine_checkpoint.py: straight training vs half + save + fresh setup + load + half.

Run by ``engine_launch.py`` (argv: cases.json, output prefix). Each case is an engine_worker case
(model, optimizer, chunk_size, cache, offload, prefetch, checkpoint, accum, clip, dtype,
plant_inf_step, steps). Per case, every rank reports both loss curves, skipped steps and loss
scales, and whether the final full weights are bitwise equal; the first case also checks the
fallback to model.pt on another chunk size, the error for another model, and the directory layout.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import elixir_tune
from tests.distributed.engine_plans import make_plan
from tests.distributed.engine_worker import block_list, build, global_batches, local_micro


def setup(case: dict, world: int, chunk_size: int | None = None, model_name: str | None = None):
    case = dict(case, model=model_name or case["model"])
    model, opt, _ = build(case)
    plan = make_plan(
        model,
        world,
        chunk_size or case["chunk_size"],
        cache=case.get("cache", "all"),
        offload=case.get("offload", 0.0),
        prefetch=case.get("prefetch", 0),
        checkpoint_every=case.get("checkpoint", 0),
        dtype=case.get("dtype", "fp32"),
        block_list=block_list(case),
        micro_batch_size=case.get("micro", 2),
        grad_accum_steps=case.get("accum", 1),
        seq_len=8,
    )
    return elixir_tune.setup(model, opt, plan=plan)


def train(model, opt, case: dict, rank: int, world: int, start: int, stop: int) -> tuple[list[float], list[int]]:
    accum = case.get("accum", 1)
    losses, skipped = [], []
    for step, batch in list(enumerate(global_batches(case, world)))[start:stop]:
        total = 0.0
        for k in range(accum):
            loss = model(**local_micro(batch, rank, world, accum, k)).loss / accum
            opt.backward(loss)
            total += float(loss.detach())
        if case.get("plant_inf_step") == step and rank == world - 1:
            model.engine.chunks[0].grad[0] = float("inf")
        if case.get("clip"):
            opt.clip_grad_norm(case["clip"])
        before = opt.skipped_steps
        opt.step()
        skipped.append(opt.skipped_steps - before)
        opt.zero_grad()
        losses.append(total)
    return losses, skipped


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_case(case: dict, rank: int, world: int, directory: Path, extras: bool) -> dict:
    steps = case["steps"]
    half = steps // 2
    model, opt = setup(case, world)
    straight, straight_skipped = train(model, opt, case, rank, world, 0, steps)
    straight_state = model.state_dict(all_ranks=True)
    straight_scale = opt.loss_scale

    model, opt = setup(case, world)
    first, first_skipped = train(model, opt, case, rank, world, 0, half)
    if rank == 0:  # the leftovers of a save whose job died must not matter (and are removed)
        Path(directory, ".step-000099.tmp").mkdir(parents=True, exist_ok=True)
        Path(directory, ".step-000099.tmp", "rank-00000.pt").write_bytes(b"partial")
    saved = elixir_tune.save_checkpoint(directory, model, opt, step=half, extra={"note": "half"})
    saved_state = model.state_dict(all_ranks=True)
    del model, opt

    model, opt = setup(case, world)
    meta = elixir_tune.load_checkpoint(directory, model, opt)
    second, second_skipped = train(model, opt, case, rank, world, meta["step"], steps)
    result = {
        "straight": straight,
        "resumed": first + second,
        "exact": meta["exact"],
        "step": meta["step"],
        "extra": meta["extra"],
        "skipped": [straight_skipped, first_skipped + second_skipped],
        "scales": [straight_scale, opt.loss_scale],
        "same_weights": same_state(straight_state, model.state_dict(all_ranks=True)),
        "saved": str(saved.relative_to(directory)),
        "latest": (directory / "latest").read_text().strip(),
        "files": sorted(p.name for p in saved.iterdir()),
        "leftovers": sorted(p.name for p in directory.iterdir() if p.name not in ("latest", ".lock", saved.name)),
    }
    if extras:
        # Another chunk size: weights only, with a warning.
        model, opt = setup(case, world, chunk_size=case["chunk_size"] * 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            meta = elixir_tune.load_checkpoint(directory, model, opt)
        result["fallback_exact"] = meta["exact"]
        result["fallback_warning"] = " ".join(str(w.message) for w in caught)
        result["fallback_weights"] = same_state(saved_state, model.state_dict(all_ranks=True))
        torch_loaded = torch.load(saved / "model.pt", weights_only=True)
        result["model_pt_weights"] = same_state(saved_state, torch_loaded)
        # Another model: a clear error.
        other = "tied" if case["model"] == "gpt2" else "gpt2"
        model, opt = setup(dict(case, chunk_size=1024), world, model_name=other)
        try:
            elixir_tune.load_checkpoint(directory, model, opt)
            result["mismatch_error"] = ""
        except ValueError as error:
            result["mismatch_error"] = str(error)
        try:
            elixir_tune.load_checkpoint(directory.parent / "missing", model, opt)
            result["missing_error"] = ""
        except elixir_tune.engine.CheckpointError as error:
            result["missing_error"] = str(error)
        # A save that died between its renames: the complete copy beside the directory is used.
        import torch.distributed as dist

        dist.barrier()
        if rank == 0:
            saved.rename(directory / f".{saved.name}.tmp")
        dist.barrier()
        model, opt = setup(case, world)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            meta = elixir_tune.load_checkpoint(directory, model, opt)
        noted = "interrupted" in " ".join(str(w.message) for w in caught)
        result["renamed_exact"] = meta["exact"] and noted == (rank == 0)  # the note comes once, from rank 0
        result["renamed_weights"] = same_state(saved_state, model.state_dict(all_ranks=True))
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(
        lambda case, index, rank, world, out_path: run_case(
            case, rank, world, Path(f"{out_path}.ckpt{index}"), extras=index == 0
        )
    )
