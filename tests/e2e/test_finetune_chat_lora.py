"""Chat data, packed, with LoRA, as a user runs it from a directory that is not the repository: a Llama-style
directory (tokenizer with a chat template) -> ``elixir-tune profile DIR --lora-rank 4 --lora-targets q_proj,v_proj``
-> ``search`` (its printed command carries the --lora-* options) -> ``elixir-run plan.yaml finetune`` on 2 CPU
workers with a ``messages`` JSONL file, ``--packing``, a saved ``datasets`` directory as the eval file and
``--save-pretrained OUT``.

One launch checks: the format is detected and printed, the rows are packed; the evaluation loss falls and its last
value equals plain PEFT's token-weighted loss (assistant tokens only) over the same eval batches with the saved
adapter; OUT is PEFT's adapter format plus the tokenizer, ``PeftModel.from_pretrained`` loads it and generates."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.e2e.launch_helpers import run_elixir, tune
from tests.fixtures.tiny_hf import CONVERSATIONS, make_llama_dir, write_formats

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SEQ_LEN, GLOBAL_BATCH, STEPS, EVAL_EVERY = 128, 4, 10, 5
LORA = ["--lora-rank", "4", "--lora-targets", "q_proj,v_proj"]


def plain_peft_eval_loss(model_dir: Path, adapter_dir: Path, data: Path, eval_dir: Path) -> tuple[float, int]:
    """(token-weighted mean loss over the eval file, its loss tokens) with transformers + PEFT on one process."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from elixir_tune.data import load_data
    from elixir_tune.recipes.finetune import build_parser
    from elixir_tune.recipes.finetune_options import data_spec

    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter_dir).eval()
    args = build_parser().parse_args(["--data", str(data), "--eval-data", str(eval_dir), "--packing"])
    split = load_data(data_spec(args), tokenizer, SEQ_LEN)
    weighted, tokens = 0.0, 0
    with torch.no_grad():
        for batch in split.eval_batches(3):
            count = int((batch["labels"][:, 1:] != -100).sum())
            if count:
                weighted += float(model(**batch).loss) * count
                tokens += count
    return weighted / tokens, tokens


def test_chat_data_packed_with_lora_at_world_2(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = make_llama_dir(tmp_path / "tiny-llama")
    files = write_formats(tmp_path / "data")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 3))
    tune(["profile", model_dir, "--batch-size", "2", "--seq-len", SEQ_LEN, *LORA], tmp_path)
    searched = tune(
        ["search", "--loop", "plain", "--gpus", "2", "--hardware", "cpu", "--global-batch-size", GLOBAL_BATCH],
        tmp_path,
    )
    printed = re.search(r"run it with `elixir-run plan\.yaml (finetune [^`]+)`", searched.stdout)
    assert printed, searched.stdout[-1500:]
    assert printed.group(1) == (
        f"finetune --model {model_dir} --data FILE --lora-rank 4 --lora-alpha 8 --lora-targets q_proj,v_proj"
    )

    out, log = tmp_path / "adapter", tmp_path / "train.json"
    command = printed.group(1).replace("FILE", str(chat)).split()[1:]
    result = run_elixir(
        ["plan.yaml", "finetune", *command, "--packing", "--eval-data", files["messages_dataset"]]
        + ["--steps", STEPS, "--eval-every", EVAL_EVERY, "--lr", "3e-2", "--log", log, "--save-pretrained", out],
        timeout_s=400,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert f"data: {chat}: messages (detected from fields messages)" in result.stdout, result.stdout[-2000:]
    assert "packed into" in result.stdout and "the LoRA adapter" in result.stdout

    record = json.loads(log.read_text())
    evals = record["evals"]
    assert [e["step"] for e in evals] == [EVAL_EVERY, STEPS]
    assert evals[-1]["loss"] < evals[0]["loss"], evals
    expected_loss, eval_tokens = plain_peft_eval_loss(model_dir, out, chat, files["messages_dataset"])
    assert evals[-1]["tokens"] == eval_tokens
    assert evals[-1]["loss"] == pytest.approx(expected_loss, rel=1e-5)

    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out)
    moved = max(float(p.abs().max()) for n, p in tuned.named_parameters() if "lora_B" in n)
    assert moved > 1e-4, "training moved the adapters (lora_B starts at zero)"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    generated = tuned.generate(**prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 5
