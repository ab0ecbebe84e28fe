"""What `elixir-tune bench` and `search --measure` run for a model, and their answers to bad input."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from elixir_tune.cli.bench import trial_script
from elixir_tune.cli.main import cli


def _profile(**kwargs):
    return SimpleNamespace(**{"source": "gpt2-tiny", "lora": {}, "inputs": [], "token_vocab": 0, **kwargs})


def test_trials_train_from_scratch_on_synthetic_tokens_unless_data_is_given():
    assert trial_script(_profile(), None) == ["pretrain", "--synthetic"]
    assert trial_script(_profile(), "text.txt") == ["pretrain", "--data", "text.txt"]
    # a vocabulary below 256 already gets synthetic tokens; the trial sets its own step count
    assert trial_script(_profile(token_vocab=64), None) == ["pretrain", "--synthetic"]


def test_a_fine_tuned_model_needs_data_for_its_trials(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    result = CliRunner().invoke(cli, ["bench", "--help"])
    assert result.exit_code == 0 and "--budget" in result.output
    with pytest.raises(SystemExit) as stop:
        trial_script(_profile(source=str(tmp_path)), None)
    assert stop.value.code == 1
    assert trial_script(_profile(source=str(tmp_path)), "chat.jsonl")[:2] == ["finetune", "--model"]


def test_bench_refuses_a_missing_plan_file(tmp_path):
    result = CliRunner().invoke(cli, ["bench", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_search_lists_its_measure_and_engine_options():
    result = CliRunner().invoke(cli, ["search", "--help"])
    for option in ("--measure", "--measure-budget", "--measure-top", "--engine"):
        assert option in result.output
