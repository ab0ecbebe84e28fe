"""`elixir-run PLAN RECIPE ...`: a bare name runs a recipe of the package; bad inputs stop in elixir-run's own
process (one line each, exit 2) before any worker starts. No torchrun here: the workers would print "starting"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from elixir_tune.cli.run import run_command
from elixir_tune.paths import REPO_DIR
from elixir_tune.recipes import is_recipe_name, recipe_module

EXAMPLE_PLAN = REPO_DIR / "configs" / "plans" / "example.yaml"


def _invoke(args: list, cwd: Path) -> tuple[int, str]:
    """elixir-run in this process, from ``cwd`` (not the repository)."""
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(run_command, [str(arg) for arg in args])
    finally:
        os.chdir(previous)
    return result.exit_code, result.output


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def test_names_and_paths():
    assert is_recipe_name("finetune") and is_recipe_name("pretrain") and is_recipe_name("finetuen")
    assert not is_recipe_name("train.py") and not is_recipe_name("./finetune") and not is_recipe_name("a/b")
    assert recipe_module("finetune") == "elixir_tune.recipes.finetune"


def test_an_unknown_recipe_lists_the_recipes(tmp_path: Path):
    code, output = _invoke([EXAMPLE_PLAN, "finetuen", "--steps", "2"], tmp_path)
    assert code == 2, output
    (line,) = _errors(output)
    assert "'finetuen' is neither a recipe nor a file" in line and "finetune (" in line and "pretrain (" in line
    assert "starting" not in output


def test_missing_data_and_model_are_one_line_each_before_anything_starts(tmp_path: Path):
    code, output = _invoke(
        [EXAMPLE_PLAN, "finetune", "--model", tmp_path / "no-model", "--data", tmp_path / "no.txt"], tmp_path
    )
    assert code == 2, output
    assert _errors(output) == [
        f"error: --data {tmp_path / 'no.txt'}: no such file",
        f"error: --model {tmp_path / 'no-model'}: no such directory (looked in {tmp_path} and beside the plan); "
        "give a Hugging Face model directory or a Hub name (owner/name) in the local cache",
    ]
    assert "nothing was started" in output and "Traceback" not in output and "starting" not in output


def test_a_model_dir_without_config_and_a_bad_option(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    code, output = _invoke([EXAMPLE_PLAN, "finetune", "--model", tmp_path / "empty"], tmp_path)
    assert code == 2 and _errors(output) == [
        f"error: --model {tmp_path / 'empty'}: not a model directory (no config.json); give a Hugging Face model dir"
    ]
    code, output = _invoke([EXAMPLE_PLAN, "pretrain", "--stepz", "3"], tmp_path)
    assert code == 2 and _errors(output) == [
        "error: pretrain: unrecognized arguments: --stepz 3 (did you mean --steps?)"
    ], output
    # An abbreviation is not taken for the option it begins: --step 3 must not start a run of --steps 3.
    code, output = _invoke([EXAMPLE_PLAN, "pretrain", "--step", "3"], tmp_path)
    assert code == 2 and _errors(output) == [
        "error: pretrain: unrecognized arguments: --step 3 (did you mean --steps?)"
    ], output
    code, output = _invoke([EXAMPLE_PLAN, "pretrain", "--keep-best"], tmp_path)
    assert _errors(output) == ["error: pretrain: --keep-best keeps the best checkpoint under --save DIR: add --save"]


def test_a_plan_for_another_model_and_a_missing_eval_file(tmp_path: Path):
    """The example plan is for gpt2-tiny: a Llama config directory does not fit it (checked on the meta device)."""
    from transformers import LlamaConfig

    model_dir = tmp_path / "llama"
    LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=300
    ).save_pretrained(model_dir)
    data = tmp_path / "corpus.txt"
    data.write_text("some text\n\nmore text\n")
    plan = yaml.safe_load(EXAMPLE_PLAN.read_text())
    code, output = _invoke(
        [EXAMPLE_PLAN, "finetune", "--model", model_dir, "--data", data, "--eval-data", tmp_path / "eval.txt"],
        tmp_path,
    )
    assert code == 2, output
    errors = _errors(output)
    assert errors[0] == f"error: --eval-data {tmp_path / 'eval.txt'}: no such file"
    assert errors[1].startswith(
        f"error: the plan was made for another model (fingerprint {plan['model']['fingerprint']}"
    )
    assert errors[1].endswith(f"`elixir-tune profile {model_dir}` and search again")
    assert len(errors) == 2 and "starting" not in output


def test_a_logger_that_is_not_installed(tmp_path: Path):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    code, output = _invoke([EXAMPLE_PLAN, "pretrain", "--model", "gpt2-tiny", "--wandb", "my-project"], tmp_path)
    assert code == 2 and _errors(output) == [
        "error: --wandb my-project logs to Weights & Biases: pip install wandb (and `wandb login`)"
    ], output


def test_a_json_data_file_of_one_object_is_refused_before_anything_starts(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    data = tmp_path / "corpus.json"
    data.write_text('{"text": "all of it in one object"}')
    code, output = _invoke([EXAMPLE_PLAN, "finetune", "--model", tmp_path / "empty", "--data", data], tmp_path)
    assert code == 2 and "starting" not in output, output
    assert _errors(output)[0] == (
        f"error: data file {data} holds one JSON object, not rows of records: give a JSON list of records "
        '([{"text": ...}, {"text": ...}]) or JSON Lines (.jsonl, one record per line)'
    )


def test_save_pretrained_into_a_users_folder_is_refused_before_anything_starts(tmp_path: Path):
    """The export overwrote config.json (and the rest) in a folder of the user's; an earlier export of the
    recipe (its marker file there) may still be replaced."""
    (tmp_path / "empty").mkdir()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"mine": true}')
    args = [EXAMPLE_PLAN, "finetune", "--model", tmp_path / "empty", "--save-pretrained", theirs]
    code, output = _invoke(args, tmp_path)
    assert code == 2 and "starting" not in output, output
    assert (
        f"error: --save-pretrained {theirs}: the directory holds files that are not an elixir-tune export "
        "(config.json), which the export would overwrite: give a new or empty directory, or move those files away"
    ) in _errors(output)
    (theirs / ".elixir-tune-export.json").write_text("{}")  # what an export of the recipe leaves
    code, output = _invoke(args, tmp_path)
    assert not any("--save-pretrained" in line for line in _errors(output)), output


def test_a_settings_file_with_a_wrong_key_is_refused_before_anything_starts(tmp_path: Path):
    (tmp_path / "bad.yaml").write_text("steps: 3\nlr: 3e-4\nstepz: 3\n")
    code, output = _invoke([EXAMPLE_PLAN, "pretrain", "--config", "bad.yaml", "seed=1"], tmp_path)
    assert code == 2, output
    assert _errors(output) == [
        "error: pretrain: --config bad.yaml: 'stepz': no option of this recipe has that name (did you mean --steps?); "
        "`elixir-run PLAN pretrain --help` lists them"
    ]
    assert "nothing was started" in output and "starting" not in output
    code, output = _invoke([EXAMPLE_PLAN, "pretrain", "--help"], tmp_path)
    assert code == 0 and "--config FILE" in output
    assert "KEY=VALUE arguments override it and --flags override both" in " ".join(output.split())


def test_train_passes_the_settings_file_and_overrides_to_the_recipe(tmp_path: Path, monkeypatch):
    import json

    from elixir_tune.cli.main import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ELIXIR_TUNE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "run.yaml").write_text("steps: 2\nseed: 4\n")
    args = ["train", "gpt2-tiny", "--gpus", "1", "--dry-run", "--json", "--config", "run.yaml", "lr=3e-4"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    command = json.loads(result.stdout)["command"]
    assert command[2] == "pretrain" and command[-3:] == ["--config", "run.yaml", "lr=3e-4"]
    # the command it would run gets past elixir-run's preflight, and a wrong override stops it there
    code, output = _invoke(["--dry-run", *command[1:]], tmp_path)
    assert code == 0, output
    code, output = _invoke([*command[1:], "seeds=5"], tmp_path)
    assert code == 2 and _errors(output)[0].startswith("error: pretrain: seeds=5: no option of this recipe"), output
    assert "(did you mean --seed?)" in output and "starting" not in output
