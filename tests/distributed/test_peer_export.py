"""``elixir-tune export``'s files run the engine's own way and train as plain PyTorch does (gloo, CPU,
world 2, fp32, 3 steps; losses 1e-5 relative, weights 1e-5 absolute): the FSDP2 setup file from an
fsdp2 plan offloading its first two units, and DeepSpeed's ds_config.json from a plan of our own
engine with half its chunks offloaded (ZeRO-3 with optimizer offload) under ``deepspeed.initialize``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from elixir_tune.plan import save_plan
from elixir_tune.plan.engine_choice import EngineChoice
from tests.distributed.engine_launch import launch
from tests.distributed.engine_plans import make_plan
from tests.zoo.models import SEQ, build

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def export(tmp_path: Path, target: str, **engine) -> dict:
    plan = make_plan(build("gpt2"), 2, 8192, offload=0.5 if not engine else 0.0, block_list="transformer.h",
                     micro_batch_size=2, grad_accum_steps=2, seq_len=SEQ)  # fmt: skip
    if engine:
        plan.engine = EngineChoice(**engine)
    plan_path, out = (
        tmp_path / f"{target}.plan.yaml",
        tmp_path / {"fsdp2": "fsdp2_setup.py"}.get(target, "ds_config.json"),
    )
    save_plan(plan, plan_path)
    command = [sys.executable, "-m", "elixir_tune.cli.main", "export", str(plan_path), "--to", target, "-o", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return {"target": target, "plan": str(plan_path), "exported": str(out), "notes": done.stderr}


def check(result: dict) -> None:
    assert result["ok"], f"{result.get('error')}\n{result.get('trace')}"
    assert result["loss_rel"] <= 1e-5 and result["weight_abs"] <= 1e-5, result


def test_fsdp2_export_trains_like_torch(tmp_path):
    case = export(tmp_path, "fsdp2", name="fsdp2", offload_params=True, offload_optimizer=True, offload_units=2)
    results = launch("peer_export_worker.py", [case], 2, timeout_s=300)
    for rank_results in results:
        assert rank_results[0]["ok"], rank_results[0]
    check(results[0][0])


@pytest.mark.heavy
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_deepspeed_export_trains_like_torch(tmp_path):
    case = export(tmp_path, "deepspeed")
    assert "offload share 0.50" in case["notes"], case["notes"]
    results = launch("peer_export_worker.py", [case], 2, timeout_s=600)
    for rank_results in results:
        assert rank_results[0]["ok"], rank_results[0]
    check(results[0][0])
