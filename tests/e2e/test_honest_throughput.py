"""Throughput that tells the truth on padded chat data (issue 36): short chats padded to 128 positions, trained for
one epoch on 2 CPU workers. The log's tokens are the assistant tokens the model learns from, counted here from
transformers' own assistant masks; padding and the prompt (user) tokens are reported apart, in the console, the
JSON log and TensorBoard; steps count from 1 as the console does; the run ends with the plan's prediction beside
the measured step time and memory."""

from __future__ import annotations

import json

import pytest

from tests.e2e.launch_helpers import run_elixir, tune

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SEQ_LEN, GLOBAL_BATCH, WORKERS = 128, 4, 2


def test_padded_chat_data_reports_learned_tokens_and_padding_apart(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoTokenizer

    from tests.fixtures.tiny_hf import CONVERSATIONS, make_llama_dir

    model_dir = make_llama_dir(tmp_path / "tiny-llama")
    chats = CONVERSATIONS * 2  # 8 samples: one epoch is 2 steps of 4, each sample once
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in chats))
    tune(["profile", model_dir, "--batch-size", 2, "--seq-len", SEQ_LEN], tmp_path)
    tune(["search", "--gpus", WORKERS, "--hardware", "cpu", "--global-batch-size", GLOBAL_BATCH], tmp_path)

    log, board = tmp_path / "train.json", tmp_path / "tb"
    result = run_elixir(
        ["plan.yaml", "finetune", "--model", model_dir, "--data", data, "--epochs", 1, "--log", log]
        + ["--log-dir", board],
        timeout_s=400,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    # What the model learns from, by transformers' assistant masks (nothing predicts a row's first token).
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    learned = padding = 0
    for messages in chats:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        length = len(rendered["input_ids"])
        assert length < SEQ_LEN / 2  # short chats: most of each row is padding
        learned += sum(rendered["assistant_masks"][1:])
        padding += SEQ_LEN - length
    computed = len(chats) * SEQ_LEN

    record = json.loads(log.read_text())
    steps = record["steps"]
    assert [step["step"] for step in steps] == [1, 2]  # from 1, as the console counts
    assert sum(step["tokens"] for step in steps) == learned
    assert sum(step["tokens_padding"] for step in steps) == padding
    assert sum(step["tokens_computed"] for step in steps) == computed
    assert sum(step["tokens_no_loss"] for step in steps) == computed - padding - learned > 0  # the user turns
    for step in steps:
        assert step["tokens_per_s"] == pytest.approx(step["tokens"] / step["step_time_s"], rel=1e-9)
        assert step["computed_tokens_per_s"] == pytest.approx(SEQ_LEN * GLOBAL_BATCH / step["step_time_s"], rel=1e-9)
        assert step["computed_tokens_per_s"] > 3 * step["tokens_per_s"]  # the old figure overstated it this much
    summary = record["summary"]
    timed = steps[1:]  # the first step warms up
    assert summary["mean_tokens_per_s"] == pytest.approx(
        sum(step["tokens"] for step in timed) / sum(step["step_time_s"] for step in timed), rel=1e-9
    )
    assert (summary["tokens"], summary["tokens_padding"], summary["tokens_computed"]) == (learned, padding, computed)
    check = summary["prediction"]
    assert check["predicted_step_time_s"] > 0 and check["step_time_ratio"] == pytest.approx(
        summary["mean_step_time_s"] / check["predicted_step_time_s"]
    )

    lines = result.stdout.splitlines()
    # Said before the first step too, with what --packing would do about it (tests/unit/test_padding_note.py).
    padded = f"rows are padded to {SEQ_LEN} tokens: {padding / computed:.0%} of the tokens computed are padding; "
    assert any(line.startswith(padded + f"--packing would pack the {len(chats)} samples into") for line in lines)
    (first,) = [line for line in lines if line.startswith("step     1/2")]
    assert "tok/s learned (of" in first and "% padding" in first and "% no loss" in first, first
    assert any(line.startswith("plan vs run: step time") and "predicted" in line for line in lines), lines[-5:]
    assert "\x1b[" not in result.stdout  # not a terminal: no escape codes

    events = EventAccumulator(str(board))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/tokens_per_s", "train/computed_tokens_per_s", "train/padding_fraction"} <= set(tags)
    padding_fractions = [event.value for event in events.Scalars("train/padding_fraction")]
    assert [event.step for event in events.Scalars("train/tokens_per_s")] == [1, 2]
    assert sum(padding_fractions) / 2 == pytest.approx(padding / computed, rel=1e-6)
