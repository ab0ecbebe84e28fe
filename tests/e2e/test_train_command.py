"""`elixir-tune train`: from a model directory and a chat file to a LoRA adapter that PEFT loads, in one command
(issue 36). The first run profiles, searches and trains (the LoRA settings given once: the plan carries them to
the recipe); the second finds the profile and plan in its cache; other settings make another plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

BIN_DIR = Path(sys.executable).parent


def _train(args: list, cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env.update({"ELIXIR_TUNE_CACHE": str(cache), "PYTHONUNBUFFERED": "1"})
    return subprocess.run(
        [str(BIN_DIR / "elixir-tune"), "train", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )


def test_one_command_fine_tunes_with_lora_and_reuses_its_plan(tmp_path: Path):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    from tests.fixtures.tiny_hf import CONVERSATIONS, make_llama_dir

    model_dir = make_llama_dir(tmp_path / "tiny-llama")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in CONVERSATIONS * 2))
    cache, out = tmp_path / "cache", tmp_path / "adapter"
    settings = ["--lora-rank", 4, "--lora-targets", "q_proj,v_proj", "--seq-len", 128, "--global-batch-size", 4]

    first = _train([model_dir, "--data", chat, *settings, "--epochs", 1, "--save-pretrained", out], tmp_path, cache)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    lines = first.stdout.splitlines()
    assert lines[0].startswith("plan: tiny-llama (") and "LoRA rank 4" in lines[0] and "seq 128" in lines[0]
    assert lines[1].startswith("memory: ") and lines[2].startswith("predicted: ")
    assert lines[3].startswith("plan file: ") and "reused" not in lines[3]
    plan_file = lines[3].removeprefix("plan file: ")
    recipe = f"finetune --model {model_dir} --data {chat} --epochs 1 --save-pretrained {out}"  # no --lora-*
    assert lines[4] == f"running: elixir-run {plan_file} {recipe}"
    assert "done: loss" in first.stdout and "plan vs run: step time" in first.stdout
    plans = list((cache / "plans").glob("plan-*.yaml"))
    assert len(plans) == 1
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    assert max(float(p.abs().max()) for n, p in tuned.named_parameters() if "lora_B" in n) > 0  # trained
    # PEFT's own loader finds the base from the adapter alone.
    auto = AutoPeftModelForCausalLM.from_pretrained(out)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_dir.resolve())
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(auto(input_ids=ids).logits, tuned(input_ids=ids).logits)

    again = _train([model_dir, "--data", chat, *settings, "--epochs", 1, "--dry-run"], tmp_path, cache)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"plan file: {plans[0]} (cached profile and plan reused)" in again.stdout
    (command,) = [line for line in again.stdout.splitlines() if line.startswith("elixir-run ")]
    assert command == f"elixir-run {plans[0]} finetune --model {model_dir} --data {chat} --epochs 1"  # no --lora-*

    as_json = _train([model_dir, "--data", chat, *settings, "--epochs", 1, "--dry-run", "--json"], tmp_path, cache)
    assert as_json.returncode == 0, as_json.stderr[-3000:]
    report = json.loads(as_json.stdout)  # the document alone on stdout
    assert report["command"] == ["elixir-run", str(plans[0]), *command.split()[2:]] and report["reused"]

    longer = _train([model_dir, "--data", chat, *settings[:-4], "--seq-len", 64, "--dry-run"], tmp_path, cache)
    assert longer.returncode == 0 and "seq 64" in longer.stdout and "reused" not in longer.stdout
    assert len(list((cache / "plans").glob("plan-*.yaml"))) == 2

    plans[0].write_text("schema_version: 1\n")  # a damaged cache entry is made again, never a traceback
    repaired = _train([model_dir, "--data", chat, *settings, "--epochs", 1, "--dry-run"], tmp_path, cache)
    assert repaired.returncode == 0, repaired.stderr[-3000:]
    assert f"plan file: {plans[0]} (cached profile reused)" in repaired.stdout
