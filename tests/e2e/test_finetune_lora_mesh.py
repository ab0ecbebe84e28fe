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

import pytest

from tests.e2e.launch_helpers import packed_eval_loss, printed_finetune, profiled_chat_lora, run_elixir, tune

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SEQ_LEN, GLOBAL_BATCH, STEPS = 64, 4, 4
LORA = ["--lora-rank", "4", "--lora-targets", "q_proj,v_proj,down_proj"]


@pytest.mark.heavy  # CI time: 16 s; LoRA over pipeline x tensor stays covered in CI by tests/distributed (lora_mesh)
def test_a_lora_plan_pinned_to_pipeline_x_tensor_runs_the_packed_finetune_and_merges(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from elixir_tune.plan import load_plan

    run = profiled_chat_lora(tmp_path, SEQ_LEN, 1, LORA)
    pins = ["--fix", "pipeline=2", "--fix", "tensor=2"]
    searched = tune(
        ["search", "--loop", "forward_backward", "--gpus", "4", "--hardware", "cpu"]
        + ["--global-batch-size", GLOBAL_BATCH, *pins],
        tmp_path,
    )
    plan = load_plan(tmp_path / "plan.yaml")
    assert (plan.parallel.pipeline.stages, plan.parallel.tensor.degree, plan.parallel.tensor.mode) == (2, 2, "1d")
    assert {chunk.stage for chunk in plan.memory.chunks if chunk.frozen} == {0, 1}
    printed = printed_finetune(searched.stdout)
    assert "--lora-rank 4" in printed, printed

    out, log = tmp_path / "merged", tmp_path / "train.json"
    command = printed.replace("FILE", str(run.chat)).split()[1:]
    result = run_elixir(
        ["plan.yaml", "finetune", *command, "--packing", "--eval-data", run.eval_dir]
        + ["--steps", STEPS, "--eval-every", STEPS, "--lr", "3e-2", "--log", log]
        + ["--save-pretrained", out, "--merge-lora"],
        timeout_s=500,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "packed into" in result.stdout, result.stdout[-2000:]

    evals = json.loads(log.read_text())["evals"]
    assert [e["step"] for e in evals] == [STEPS]
    # plain transformers on one process, no PEFT: the adapters are merged into the weights
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    expected_loss, eval_tokens = packed_eval_loss(merged, AutoTokenizer.from_pretrained(out), run, SEQ_LEN, 1)
    assert evals[-1]["tokens"] == eval_tokens
    assert evals[-1]["loss"] == pytest.approx(expected_loss, rel=1e-5)
