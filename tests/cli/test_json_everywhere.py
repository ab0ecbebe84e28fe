"""The README says every command has ``--json``: each command of ``elixir-tune`` and ``elixir-run`` has
the option, and the cheap form of each prints one JSON document alone on stdout. (``probe --json``
and ``bench --json`` measure the machine: tests/cli/test_probe_cli.py and tests/e2e/test_measure.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from elixir_tune.cli.main import cli
from elixir_tune.cli.run import run_command
from elixir_tune.paths import CONFIGS_DIR

EXAMPLE = str(CONFIGS_DIR / "plans" / "example.yaml")
MEASURING = {"probe", "bench"}  # their --json is tested where they measure


def test_every_command_has_a_json_option():
    for name, command in [*cli.commands.items(), ("elixir-run", run_command)]:
        options = {opt for param in command.params for opt in param.opts}
        assert "--json" in options, f"{name} has no --json"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A profile and a plan of GPT-2 tiny, written by the commands themselves."""
    work = tmp_path_factory.mktemp("json")
    runner = CliRunner()
    model = str(CONFIGS_DIR / "models" / "gpt2-tiny.yaml")
    assert runner.invoke(cli, ["profile", model, "--out", str(work / "p.yaml")]).exit_code == 0
    searched = runner.invoke(cli, ["search", "--profile", str(work / "p.yaml"), "--gpus", "2", "--hardware", "cpu",
                                   "--out", str(work / "plan.yaml")])  # fmt: skip
    assert searched.exit_code == 0, searched.output
    return work


def _document(command, args: list[str]) -> object:
    result = CliRunner().invoke(command, args)  # click keeps stderr (progress, notes) apart
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", ["profile", "search", "show", "validate", "export", "train", "elixir-run"])
def test_each_commands_json_is_one_document(folder: Path, name: str, monkeypatch):
    monkeypatch.chdir(folder)
    monkeypatch.setenv("ELIXIR_TUNE_CACHE", str(folder / "cache"))
    model, plan = str(CONFIGS_DIR / "models" / "gpt2-tiny.yaml"), str(folder / "plan.yaml")
    args = {
        "profile": ["profile", model, "--out", "q.yaml", "--json"],
        "search": ["search", "--profile", "p.yaml", "--gpus", "2", "--hardware", "cpu", "--out", "s.yaml", "--json"],
        "show": ["show", plan, "--json"],
        "validate": ["validate", plan, "--json"],
        "export": ["export", EXAMPLE, "--to", "deepspeed", "-o", "ds.json", "--json"],
        "train": ["train", "gpt2-tiny", "--gpus", "2", "--dry-run", "--json"],
    }
    if name == "elixir-run":
        document = _document(run_command, ["--dry-run", "--json", plan, "pretrain", "--steps", "1"])
    else:
        document = _document(cli, args[name])
    assert isinstance(document, dict) and document
