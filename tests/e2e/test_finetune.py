"""Fine-tuning a downloaded model as a user does it, from a directory that is not the repository: a Llama-style
Hugging Face directory (weights, generation config, a tokenizer trained here with a chat template) ->
``elixir-tune profile DIR`` -> ``search`` -> the command search prints, ``elixir-run plan.yaml finetune ...`` on 2
CPU workers with an evaluation split, TensorBoard logs, the best checkpoint kept and ``--save-pretrained OUT``.

One launch checks: the run length from ``--epochs``; the evaluation loss falls and its last value equals a plain
transformers computation of the token-weighted mean loss over the same split with the saved weights; OUT loads
with ``AutoModelForCausalLM`` and ``AutoTokenizer`` (chat template and generation config kept) and generates; the
weights moved from the pretrained ones; LOGS has TensorBoard scalars; ``ckpt/best`` names the best evaluation."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from elixir_tune.recipes import BUNDLED_TEXT
from tests.e2e.launch_helpers import run_elixir, tune
from tests.fixtures.tiny_hf import make_llama_dir

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

EPOCHS, EVAL_FRACTION, EVAL_EVERY, GLOBAL_BATCH, SEQ_LEN = 0.25, 0.2, 4, 8, 32


def plain_eval_loss(model_dir: Path, data: Path) -> tuple[float, int, int]:
    """(token-weighted mean loss over the split, its tokens, training samples), with plain transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from elixir_tune.data import load_data
    from elixir_tune.recipes.finetune import build_parser
    from elixir_tune.recipes.finetune_options import data_spec

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    args = build_parser().parse_args(["--data", str(data), "--eval-fraction", str(EVAL_FRACTION)])
    split = load_data(data_spec(args), tokenizer, SEQ_LEN)  # the recipe's own data path: text packed into windows
    weighted, tokens = 0.0, 0
    with torch.no_grad():
        for batch in split.eval_batches(3):  # another batch size than the run's: the mean must not depend on it
            count = int((batch["labels"][:, 1:] != -100).sum())
            weighted += float(model(**batch).loss) * count
            tokens += count
    return weighted / tokens, tokens, split.num_samples()


def test_finetune_from_outside_the_repository(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = make_llama_dir(tmp_path / "tiny-llama", max_new_tokens=7)
    data = tmp_path / "corpus.txt"
    data.write_text(BUNDLED_TEXT.read_text())
    tune(["profile", model_dir, "--batch-size", "4", "--seq-len", str(SEQ_LEN)], tmp_path)
    searched = tune(
        ["search", "--loop", "plain", "--gpus", "2", "--hardware", "cpu", "--global-batch-size", str(GLOBAL_BATCH)],
        tmp_path,
    )
    printed = re.search(r"run it with `(elixir-run plan\.yaml finetune --model \S+ --data FILE)`", searched.stdout)
    assert printed, searched.stdout[-1500:]
    assert printed.group(1) == f"elixir-run plan.yaml finetune --model {model_dir} --data FILE"

    out, logs, ckpt, log = tmp_path / "out", tmp_path / "logs", tmp_path / "ckpt", tmp_path / "train.json"
    result = run_elixir(
        ["plan.yaml", "finetune", "--model", model_dir, "--data", "corpus.txt", "--epochs", EPOCHS]
        + ["--eval-fraction", EVAL_FRACTION, "--eval-every", EVAL_EVERY, "--lr", "3e-3", "--log", log]
        + ["--save", ckpt, "--keep-best", "--save-pretrained", out, "--log-dir", logs],
        timeout_s=400,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "(400 tokens)" in result.stdout, result.stdout[-2000:]  # the directory's tokenizer, not bytes
    assert "step     1/" in result.stdout  # plain lines where the output is not a terminal

    record = json.loads(log.read_text())
    expected_loss, eval_tokens, train_samples = plain_eval_loss(out, data)
    steps = math.ceil(EPOCHS * train_samples / GLOBAL_BATCH)
    assert record["script"] == "finetune" and record["summary"]["status"] == "finished"
    assert record["steps_planned"] == steps and len(record["steps"]) == steps
    evals = record["evals"]
    assert [e["step"] for e in evals] == [*range(EVAL_EVERY, steps, EVAL_EVERY), steps]
    assert evals[-1]["loss"] < evals[0]["loss"], evals
    # Both data ranks evaluated their share; the sums over ranks give the split's token-weighted mean.
    assert evals[-1]["tokens"] == eval_tokens
    assert evals[-1]["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert evals[-1]["perplexity"] == pytest.approx(math.exp(expected_loss), rel=1e-5)
    best = min(evals, key=lambda e: e["loss"])
    assert (ckpt / "best" / "latest").read_text().strip() == f"step-{best['step']:06d}"

    tokenizer = AutoTokenizer.from_pretrained(out)
    tuned = AutoModelForCausalLM.from_pretrained(out)
    assert tokenizer.chat_template and len(tokenizer) == 400
    assert tuned.generation_config.max_new_tokens == 7  # the source's generation config, kept
    prompt = tokenizer("Shall I compare thee", return_tensors="pt")
    generated = tuned.generate(**prompt, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 7
    pretrained = AutoModelForCausalLM.from_pretrained(model_dir)
    moved = max(float((tuned.state_dict()[k] - v).abs().max()) for k, v in pretrained.state_dict().items())
    assert moved > 1e-3, "fine-tuning changed the weights"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = logs.glob("events.out.tfevents.*")
    scalars = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/tokens_per_s", "eval/loss", "eval/perplexity"} <= set(scalars)
