"""Every command answers --help with an example, through click and through the console scripts."""

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


@pytest.mark.parametrize(
    "argv", [["elixir-tune", "--help"], ["elixir-run", "--help"]] + [["elixir-tune", c, "--help"] for c in COMMANDS]
)
def test_help_through_console_scripts(argv: list[str]):
    out = subprocess.run([_script(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Usage:" in out.stdout


def test_unknown_command_is_usage_error():
    out = subprocess.run([_script("elixir-tune"), "frobnicate"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "No such command" in out.stderr
