"""Pretrained weights in and out, and meta-device initialization, at world sizes 1, 2 and 4 (gloo, CPU).

* A tiny GPT-2 (tied head) and a tiny Llama saved by plain transformers ``save_pretrained`` (one
  file, and sharded into several files with an index) load through ``setup(..., weights=DIR)`` into
  a model built on the meta device: every rank's first-step loss equals plain ``from_pretrained``'s
  on the same micro-batch (fp32, 1e-6 relative); after 5 steps the engine's ``save_pretrained``
  writes a directory that plain ``from_pretrained`` loads with the engine's weights (1e-6).
* Meta-device initialization (GPT-2 and Llama through transformers' initializer, a plain torch
  model through ``reset_parameters``) gives bitwise the same weights and buffers at world 1, 2 and
  4, for two chunk sizes, with and without offload.

World 1 runs in this process (a world of one needs no process group); worlds 2 and 4 are one launch each.
"""

from __future__ import annotations

import os

import pytest
import torch

import tests.distributed.engine_weights_worker as worker
from tests.distributed.engine_launch import launch

LOSS_REL = 1e-6
WEIGHT_ABS = 1e-6
STEPS = 5
ARCHS = ("gpt2", "llama")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Plain transformers checkpoints: one file and sharded (several files + index) per architecture."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for arch in ARCHS:
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(worker.hf_config(arch))
        model.save_pretrained(root / arch)
        model.save_pretrained(root / f"{arch}-sharded", max_shard_size="20KB")
        dirs[arch] = str(root / arch)
        dirs[f"{arch}-sharded"] = str(root / f"{arch}-sharded")
    assert len([p for p in os.listdir(dirs["gpt2-sharded"]) if p.endswith(".safetensors")]) > 1
    assert os.path.exists(os.path.join(dirs["llama-sharded"], "model.safetensors.index.json"))
    return dirs


def hf_cases(dirs: dict, out_root, world: int) -> list[dict]:
    cases = []
    for name in dirs:
        for offload in (0.0, 0.5) if world == 2 else (0.0,):
            cases.append(
                dict(
                    kind="hf",
                    name=f"{name}-w{world}-off{offload}",
                    dir=dirs[name],
                    out=str(out_root / f"{name}-w{world}-off{offload}"),
                    chunk_size=4096,
                    offload=offload,
                    steps=STEPS,
                    max_shard_size="30KB" if "sharded" in name else "5GB",
                )
            )
    return cases


INIT_CASES = [
    dict(kind="init", arch=arch, seed=11, chunk_size=chunk_size, offload=offload)
    for arch in ("gpt2", "llama", "torch")
    for chunk_size, offload in ((4096, 0.0), (12288, 0.5))
]


def run_in_process(cases: list[dict]) -> list[dict]:
    from elixir_tune.engine.io import initializer

    saved, initializer.UNIT_NUMEL = initializer.UNIT_NUMEL, worker.SMALL_UNIT_NUMEL
    try:
        return [dict(worker.run_case(case, index, 0, 1, ""), ok=True, case=case) for index, case in enumerate(cases)]
    finally:
        initializer.UNIT_NUMEL = saved


@pytest.fixture(scope="module")
def runs(hf_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    world1 = run_in_process(hf_cases(hf_dirs, out, 1) + INIT_CASES)
    world2 = launch("engine_weights_worker.py", hf_cases(hf_dirs, out, 2) + INIT_CASES, 2, timeout_s=300)
    world4 = launch("engine_weights_worker.py", INIT_CASES, 4, timeout_s=300)
    return {1: [world1], 2: world2, 4: world4}


def check_ok(results: list[list[dict]]) -> None:
    for rank, rank_results in enumerate(results):
        for result in rank_results:
            assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_hf_weights_in_and_out(runs, world):
    results = runs[world]
    check_ok(results)
    hf = [[r for r in rank_results if r["case"]["kind"] == "hf"] for rank_results in results]
    assert len(hf[0]) == (8 if world == 2 else 4)
    for rank, rank_results in enumerate(hf):
        for result in rank_results:
            name = result["case"]["name"]
            rel = abs(result["first_loss"] - result["plain_loss"]) / abs(result["plain_loss"])
            assert rel <= LOSS_REL, (name, rank, result["first_loss"], result["plain_loss"])
            if rank:
                assert result["state_keys"] == [], "state_dict() gathers to rank 0 only"
    for result in hf[0]:
        name = result["case"]["name"]
        assert result["saved_keys_missing"] == [], name
        assert result["saved_diff"] <= WEIGHT_ABS, (name, result["saved_diff"])
        assert result["moved"] > 1e3 * WEIGHT_ABS, (name, result["moved"])  # training changed the weights
        assert "config.json" in result["files"] and "generation_config.json" in result["files"], name
        if "sharded" in name:
            assert "model.safetensors.index.json" in result["files"], (name, result["files"])
            assert sum(f.endswith(".safetensors") for f in result["files"]) > 1, (name, result["files"])
        else:
            assert "model.safetensors" in result["files"], (name, result["files"])


@pytest.mark.slow
@pytest.mark.distributed
def test_meta_init_is_deterministic_across_world_and_chunk_sizes(runs):
    for world in (1, 2, 4):
        check_ok(runs[world])
    by_arch: dict[str, list[tuple[str, dict]]] = {}
    for world in (1, 2, 4):
        for result in runs[world][0]:
            case = result["case"]
            if case["kind"] == "init":
                label = f"world {world}, chunk {case['chunk_size']}, offload {case['offload']}"
                by_arch.setdefault(case["arch"], []).append((label, result))
    for arch, results in by_arch.items():
        assert len(results) == 6, arch
        assert len({r["chunks"] for _, r in results}) > 1, "two chunk sizes give different chunkings"
        first_label, first = results[0]
        values = [v for v in first["state"].values()]
        assert any(torch.tensor(v).float().std() > 0 for v in values), "random initialization happened"
        for label, result in results[1:]:
            assert result["state"].keys() == first["state"].keys()
            differing = [k for k, v in result["state"].items() if v != first["state"][k]]
            assert not differing, f"{arch}: {label} differs from {first_label} in {differing[:4]}"
        assert all(r["buffers"] == first["buffers"] for _, r in results), arch
    # Llama's rotary buffer, rebuilt on the CPU from the config (not left on meta), equals the one a
    # real construction computes.
    inv_freq = by_arch["llama"][0][1]["buffers"]["model.rotary_emb.inv_freq"]
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_config(worker.hf_config("llama"))
    assert torch.equal(torch.tensor(inv_freq), real.model.rotary_emb.inv_freq)
