"""Fine-tuning a downloaded model, as the README tells it: a Hugging Face directory (a tiny GPT-2 with
its own tokenizer, written by plain transformers) -> ``elixir-tune profile DIR`` -> ``search`` ->
``elixir-run plan.yaml scripts/finetune.py --model DIR --data FILE --save-pretrained OUT`` on 2 CPU
workers; OUT loads with plain ``from_pretrained`` and its weights moved from the pretrained ones.
(That the weights loaded are the directory's, to 1e-6, is tests/distributed/test_engine_weights.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elixir_tune.paths import REPO_DIR
from tests.e2e.launch_helpers import run_elixir, tune

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FINETUNE = REPO_DIR / "scripts" / "finetune.py"
DATA = REPO_DIR / "data" / "public_domain.txt"


def make_model_dir(directory: Path) -> None:
    """A tiny GPT-2 and a byte-level BPE tokenizer trained on the bundled text (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"])
    tokenizer.train([str(DATA)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    config = GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=len(fast), n_positions=64, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(3)
    GPT2LMHeadModel(config).save_pretrained(directory)


def test_finetune_a_model_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "tiny-gpt2"
    make_model_dir(model_dir)
    tune(["profile", model_dir, "--batch-size", "4", "--seq-len", "32"], tmp_path)
    # Data parallelism only: this path checks the chunk engine (pipeline/tensor plans are tested apart).
    tune(
        [
            "search",
            "--gpus",
            "2",
            "--hardware",
            "cpu",
            "--global-batch-size",
            "8",
            "--fix",
            "pipeline=1",
            "--fix",
            "tensor=1",
        ],
        tmp_path,
    )
    out, log = tmp_path / "out", tmp_path / "train.json"
    result = run_elixir(
        [
            tmp_path / "plan.yaml",
            FINETUNE,
            "--model",
            model_dir,
            "--data",
            DATA,
            "--steps",
            "6",
            "--lr",
            "3e-3",
            "--log",
            log,
            "--save-pretrained",
            out,
        ],
        timeout_s=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "(400 tokens)" in result.stdout, result.stdout[-2000:]  # the directory's tokenizer, not bytes
    record = json.loads(log.read_text())
    assert record["script"] == "finetune.py" and record["summary"]["status"] == "finished"
    assert len(record["steps"]) == 6
    pretrained = AutoModelForCausalLM.from_pretrained(model_dir)
    tuned = AutoModelForCausalLM.from_pretrained(out)
    moved = max(float((tuned.state_dict()[k] - v).abs().max()) for k, v in pretrained.state_dict().items())
    assert moved > 1e-3, "fine-tuning changed the weights"
    assert (out / "config.json").is_file()
