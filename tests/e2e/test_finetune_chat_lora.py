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

import pytest

from tests.e2e.launch_helpers import packed_eval_loss, printed_finetune, profiled_chat_lora, run_elixir, tune

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SEQ_LEN, GLOBAL_BATCH, STEPS, EVAL_EVERY = 128, 4, 10, 5
LORA = ["--lora-rank", "4", "--lora-targets", "q_proj,v_proj"]


def test_chat_data_packed_with_lora_at_world_2(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = profiled_chat_lora(tmp_path, SEQ_LEN, 2, LORA)
    model_dir, chat = run.model_dir, run.chat
    searched = tune(
        ["search", "--loop", "plain", "--gpus", "2", "--hardware", "cpu", "--global-batch-size", GLOBAL_BATCH],
        tmp_path,
    )
    printed = printed_finetune(searched.stdout)
    assert printed == (
        f"finetune --model {model_dir} --data FILE --lora-rank 4 --lora-alpha 8 --lora-targets q_proj,v_proj"
    )

    out, log = tmp_path / "adapter", tmp_path / "train.json"
    command = printed.replace("FILE", str(chat)).split()[1:]
    result = run_elixir(
        ["plan.yaml", "finetune", *command, "--packing", "--eval-data", run.eval_dir]
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
    # plain PEFT on one process, with the saved adapter
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out).eval()
    expected_loss, eval_tokens = packed_eval_loss(plain, AutoTokenizer.from_pretrained(out), run, SEQ_LEN, 3)
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
