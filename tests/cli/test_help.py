"""Every command answers --help with an example through click; both console scripts answer --help."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from elixir_tune.cli.main import cli
from elixir_tune.cli.run import run_command

COMMANDS = ["profile", "probe", "search", "show", "validate"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_through_click(command: str):
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output
    assert f"elixir-tune {command}" in result.output


def test_group_and_run_help_through_click():
    group = CliRunner().invoke(cli, ["--help"])
    assert group.exit_code == 0
    for command in COMMANDS:
        assert command in group.output
    run = CliRunner().invoke(run_command, ["--help"])
    assert run.exit_code == 0 and "elixir-run plan.yaml" in run.output


def _script(name: str) -> str:
    # The console scripts sit beside the interpreter that runs the tests (.venv/bin).
    found = Path(sys.executable).parent / name
    return str(found) if found.exists() else (shutil.which(name) or pytest.fail(f"{name} is not installed"))


@pytest.mark.parametrize("script", ["elixir-tune", "elixir-run"])
def test_help_through_console_scripts(script: str):
    # One fresh interpreter per script: `elixir-tune --help` loads every subcommand (main.py imports
    # them all), whose own help test_help_through_click checks in-process.
    out = subprocess.run([_script(script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"Usage: {script} " in out.stdout  # the program name the user typed


def test_unknown_command_is_usage_error():
    result = CliRunner().invoke(cli, ["frobnicate"])
    assert result.exit_code == 2
    assert "No such command" in result.stderr
