"""Plans that name a peer engine (``engine.name`` fsdp2 or deepspeed) run through ``elixir_tune.setup``
and the plain loop, and train as plain PyTorch does on the same global batches (gloo, CPU, world 2,
fp32): losses within 1e-5 relative, final weights within 1e-5 absolute after 3 steps.

One launch per engine runs six zoo families (GPT-2, Llama, Qwen3, Phi-3, Gemma2, Qwen3-MoE), with
and without offload, through the three loops (``loss.backward()``, ``optimizer.backward(loss)``,
``model.forward_backward``), with gradient accumulation, clipping and activation checkpointing.
DeepSpeed runs ZeRO stages 1 to 3 with parameter and optimizer offload (its CPU Adam).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.distributed.engine_launch import launch

LOSS_REL = 1e-5
WEIGHT_ABS = 1e-5
OFFLOAD_ALL = {"offload_params": True, "offload_optimizer": True}

FSDP2_CASES = [
    dict(family="gpt2", engine="fsdp2", reload=True),
    dict(family="llama", engine="fsdp2", settings=OFFLOAD_ALL, loop="optimizer", accum=2, clip=1.0),
    dict(family="qwen3", engine="fsdp2", settings=dict(OFFLOAD_ALL, offload_units=2), loop="forward_backward",
         accum=2, checkpoint=1),
    dict(family="phi3", engine="fsdp2", settings=dict(OFFLOAD_ALL, reshard_after_forward=False)),
    dict(family="gemma2", engine="fsdp2", settings={"reshard_after_forward": False}, clip=0.5, torch_clip=True),
    dict(family="qwen3_moe", engine="fsdp2", settings=OFFLOAD_ALL, loop="forward_backward", accum=2),
]  # fmt: skip

DEEPSPEED_CASES = [
    dict(family="gpt2", engine="deepspeed"),
    dict(family="llama", engine="deepspeed", settings=OFFLOAD_ALL, loop="optimizer", accum=2, clip=1.0),
    dict(family="qwen3", engine="deepspeed", settings=dict(zero_stage=2, offload_optimizer=True),
         loop="forward_backward", accum=2, checkpoint=1),
    dict(family="phi3", engine="deepspeed", settings=dict(zero_stage=1)),
    dict(family="gemma2", engine="deepspeed", settings=dict(offload_optimizer=True), clip=0.5, torch_clip=True),
    dict(family="qwen3_moe", engine="deepspeed", settings=OFFLOAD_ALL, loop="forward_backward", accum=2),
]  # fmt: skip

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def check(results: list[list[dict]], index: int) -> dict:
    for rank, rank_results in enumerate(results):
        result = rank_results[index]
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
    first = results[0][index]
    assert first["loss_rel"] <= LOSS_REL, first
    assert first["weight_abs"] <= WEIGHT_ABS, first
    assert first["norm_rel"] <= LOSS_REL, first
    return first


@pytest.fixture(scope="module")
def fsdp2_world2():
    return launch("peer_engines_worker.py", FSDP2_CASES, 2, timeout_s=600)


@pytest.mark.parametrize("index", range(len(FSDP2_CASES)), ids=[case["family"] for case in FSDP2_CASES])
def test_fsdp2_plan_matches_torch(fsdp2_world2, index):
    first = check(fsdp2_world2, index)
    assert first["units"] == first["blocks"] + 1, first  # one fully_shard unit per block, plus the root
    assert first["offloaded_units"] == first["expected_offloaded_units"], first
    if first["case"].get("reload"):
        assert first["reload_ok"], "model.load_state_dict did not reach the shards"


@pytest.fixture(scope="module")
def deepspeed_world2():
    return launch("peer_engines_worker.py", DEEPSPEED_CASES, 2, timeout_s=900)


# DeepSpeed is an optional extra, and its first use compiles two C++ ops (its CPU Adam and its
# shared-memory collectives: about 10 minutes of a loaded 2-core machine, cached afterwards).
@pytest.mark.heavy
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
@pytest.mark.parametrize("index", range(len(DEEPSPEED_CASES)), ids=[case["family"] for case in DEEPSPEED_CASES])
def test_deepspeed_plan_matches_torch(deepspeed_world2, index):
    check(deepspeed_world2, index)
