"""A LoRA fine-tune searched with the layout pinned to pipeline 2 x tensor 2 runs as the search printed it, with
packed chat rows: a Llama-style directory -> ``elixir-tune profile DIR --lora-rank 4 ...`` -> ``search --gpus 4
--loop forward_backward --fix pipeline=2 --fix tensor=2`` -> ``elixir-run plan.yaml finetune ... --packing
--save-pretrained OUT --merge-lora`` on 4 CPU workers (one job).

Checks: the plan is pipeline 2 x tensor 2 with the base in frozen chunks on both stages; the job trains on packed
rows (their position ids through both stages of tensor pieces) and evaluates; OUT is a plain transformers model
(the adapters merged) whose token-weighted loss over the same eval batches in one process equals the job's last
evaluation (1e-5).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.e2e.launch_helpers import run_elixir, tune
from tests.fixtures.tiny_hf import CONVERSATIONS, make_llama_dir, write_formats

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SEQ_LEN, GLOBAL_BATCH, STEPS = 64, 4, 4
LORA = ["--lora-rank", "4", "--lora-targets", "q_proj,v_proj,down_proj"]


def plain_eval_loss(merged_dir, data, eval_dir) -> tuple[float, int]:
    """(token-weighted mean loss over the eval file, its loss tokens) with plain transformers on one process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from elixir_tune.data import load_data
    from elixir_tune.recipes.finetune import build_parser
    from elixir_tune.recipes.finetune_options import data_spec

    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    model = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not any("lora" in name for name, _ in model.named_parameters())
    args = build_parser().parse_args(["--data", str(data), "--eval-data", str(eval_dir), "--packing"])
    split = load_data(data_spec(args), tokenizer, SEQ_LEN)
    weighted, tokens = 0.0, 0
    with torch.no_grad():
        for batch in split.eval_batches(1):
            count = int((batch["labels"][:, 1:] != -100).sum())
            if count:
                weighted += float(model(**batch).loss) * count
                tokens += count
    return weighted / tokens, tokens


def test_a_lora_plan_pinned_to_pipeline_x_tensor_runs_the_packed_finetune_and_merges(tmp_path):
    from elixir_tune.plan import load_plan

    model_dir = make_llama_dir(tmp_path / "tiny-llama")
    files = write_formats(tmp_path / "data")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 3))
    tune(["profile", model_dir, "--batch-size", "1", "--seq-len", SEQ_LEN, *LORA], tmp_path)
    pins = ["--fix", "pipeline=2", "--fix", "tensor=2"]
    searched = tune(
        ["search", "--loop", "forward_backward", "--gpus", "4", "--hardware", "cpu"]
        + ["--global-batch-size", GLOBAL_BATCH, *pins],
        tmp_path,
    )
    plan = load_plan(tmp_path / "plan.yaml")
    assert (plan.parallel.pipeline.stages, plan.parallel.tensor.degree, plan.parallel.tensor.mode) == (2, 2, "1d")
    assert {chunk.stage for chunk in plan.memory.chunks if chunk.frozen} == {0, 1}
    printed = re.search(r"run it with `elixir-run plan\.yaml (finetune [^`]+)`", searched.stdout)
    assert printed and "--lora-rank 4" in printed.group(1), searched.stdout[-1500:]

    out, log = tmp_path / "merged", tmp_path / "train.json"
    command = printed.group(1).replace("FILE", str(chat)).split()[1:]
    result = run_elixir(
        ["plan.yaml", "finetune", *command, "--packing", "--eval-data", files["messages_dataset"]]
        + ["--steps", STEPS, "--eval-every", STEPS, "--lr", "3e-2", "--log", log]
        + ["--save-pretrained", out, "--merge-lora"],
        timeout_s=500,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "packed into" in result.stdout, result.stdout[-2000:]

    evals = json.loads(log.read_text())["evals"]
    assert [e["step"] for e in evals] == [STEPS]
    expected_loss, eval_tokens = plain_eval_loss(out, chat, files["messages_dataset"])
    assert evals[-1]["tokens"] == eval_tokens
    assert evals[-1]["loss"] == pytest.approx(expected_loss, rel=1e-5)
