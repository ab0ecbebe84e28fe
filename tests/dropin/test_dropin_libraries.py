"""Scripts written for transformers' Trainer, TRL's SFTTrainer and accelerate, unchanged, under elixir-run.

Each runs as written under torchrun (the reference: DDP through accelerate, 2 processes, gloo) and
under elixir-run with the three plans of harness.py. Nothing in the scripts names elixir-tune: the
worker sets the model and its optimizer up on the plan where accelerate prepares them
(elixir_tune/integrations/accelerate.py). fp32: the logged losses within 1e-6 relative over 20 steps,
and the saved model loads with ``from_pretrained`` and equals the reference's within 1e-6.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.dropin.harness import HERE, plans, relative_gap, script_env
from tests.e2e.launch_helpers import run_elixir

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LOSS_REL = 1e-6
WEIGHT_ABS = 1e-6
SCRIPTS = ["tiny_llama_model.py", "train_trainer.py", "train_trl.py", "train_accelerate.py"]
# CI's time budget: the chunk-releasing plan there, all three with `scripts/test.sh --all`.
SOME_PLANS = [
    pytest.param(p, marks=[] if p == "released" else [pytest.mark.heavy]) for p in ("default", "released", "offload")
]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("libraries")
    for name in SCRIPTS:
        shutil.copy(HERE / name, work / name)
    return work, plans(work / "tiny_llama_model.py", work, 32, 16, 8192)


def _torchrun(work, script: str, out: str) -> list[float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, out]
    done = subprocess.run(command, cwd=work, env=script_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((work / out / "losses.json").read_text())


def _elixir(work, plan, script: str, out: str) -> list[float]:
    done = run_elixir(["--collective-timeout", 60, plan, script, out], timeout_s=300, cwd=work)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "never called elixir_tune.setup" not in done.stderr  # the plan was used
    return json.loads((work / out / "losses.json").read_text())


def _assert_same_saved_model(found, expected) -> None:
    from transformers import AutoModelForCausalLM

    mine, theirs = (AutoModelForCausalLM.from_pretrained(path).state_dict() for path in (found, expected))
    assert set(mine) == set(theirs)
    worst = max((mine[name] - value).abs().max().item() for name, value in theirs.items())
    assert worst < WEIGHT_ABS, worst
    assert all(torch.isfinite(value).all() for value in mine.values())


def _run_both(work, plan: str, library: str) -> None:
    """The library's script under torchrun DDP (once) and under elixir-run with ``plan``: the same 20
    logged losses and the same saved model, in ``LIBRARY-ddp`` and ``LIBRARY-PLAN``."""
    directory, plan_files = work
    script = f"train_{library}.py"
    if not (directory / f"{library}-ddp" / "losses.json").exists():
        _torchrun(directory, script, f"{library}-ddp")
    expected = json.loads((directory / f"{library}-ddp" / "losses.json").read_text())
    found = _elixir(directory, plan_files[plan], script, f"{library}-{plan}")
    assert len(found) == 20 and relative_gap(found, expected) < LOSS_REL
    _assert_same_saved_model(directory / f"{library}-{plan}", directory / f"{library}-ddp")


@pytest.mark.parametrize("plan", SOME_PLANS)
def test_an_unchanged_trainer_script_matches_ddp_and_saves_a_model_transformers_loads(work, plan):
    _run_both(work, plan, "trainer")


@pytest.mark.parametrize("plan", SOME_PLANS)
def test_an_unchanged_trl_sft_script_matches_ddp_and_saves_a_model_transformers_loads(work, plan):
    """SFTTrainer's fused LM head reads the head's weight in the model's own forward: the engine gathers it."""
    pytest.importorskip("trl", reason="trl is not installed (scripts/test.sh --oldest leaves it out)")
    _run_both(work, plan, "trl")


@pytest.mark.parametrize("plan", SOME_PLANS)
def test_an_unchanged_accelerate_loop_matches_ddp_with_its_documented_final_saves(work, plan):
    from safetensors.torch import load_file

    _run_both(work, plan, "accelerate")
    directory = work[0]
    saved = load_file(directory / f"accelerate-{plan}" / "save_model" / "model.safetensors")
    reference = load_file(directory / "accelerate-ddp" / "save_model" / "model.safetensors")
    assert max((saved[k] - v).abs().max().item() for k, v in reference.items()) < WEIGHT_ABS
