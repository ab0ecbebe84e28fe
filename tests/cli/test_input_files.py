"""Broken input files (binary, not UTF-8, truncated) and plans too big for this node: every command
answers with one line naming the file and what is wrong, never a traceback; elixir-run refuses a
plan that does not fit this node's memory unless --force."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from elixir_tune.cli.main import cli
from elixir_tune.cli.run import run_command
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.files import InputFileError, load_json, load_yaml
from elixir_tune.hardware import load_hardware, preset_path
from elixir_tune.paths import REPO_DIR
from elixir_tune.profiler.schema import load_profile, save_profile

EXAMPLE_PLAN = REPO_DIR / "configs" / "plans" / "example.yaml"
WORKER = REPO_DIR / "tests" / "e2e" / "workers" / "allreduce_worker.py"


def _no_traceback(result) -> None:
    # A clean error exits through SystemExit; anything else is a traceback for the user.
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output


@pytest.fixture
def binary_plan(tmp_path: Path) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    return path


@pytest.mark.parametrize("command", ["validate", "show", "elixir-run"])
def test_a_binary_plan_is_one_clear_line(binary_plan, command):
    if command == "elixir-run":
        result = CliRunner().invoke(run_command, [str(binary_plan), str(WORKER)])
    else:
        result = CliRunner().invoke(cli, [command, str(binary_plan)])
    _no_traceback(result)
    assert result.exit_code == 1
    assert "is a binary file, not a plan" in result.output
    assert str(binary_plan) in result.output


def test_a_plan_that_is_not_utf8_names_the_byte(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_bytes(EXAMPLE_PLAN.read_bytes().replace(b"gpt2-tiny", b"gpt2-\xe9", 1))
    result = CliRunner().invoke(cli, ["validate", str(path)])
    _no_traceback(result)
    assert result.exit_code == 1 and "is not UTF-8 text (byte 0xe9 at offset" in result.output


def test_a_truncated_hardware_file_names_what_is_missing(tmp_path):
    text = preset_path("l4-24gb").read_text()
    cut = tmp_path / "hw.yaml"
    cut.write_text(text[: len(text) // 3])
    with pytest.raises(InputFileError) as caught:
        load_hardware(str(cut))
    message = str(caught.value)
    assert message.startswith(f"{cut}: ") and "\n" not in message
    assert "truncated" in message or "YAML syntax error" in message


def test_a_truncated_profile_is_one_line_through_search(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_profile(gpt2_profile("gpt2-4b"), tmp_path / "full.yaml")
    text = (tmp_path / "full.yaml").read_text()
    for fraction in (0.2, 0.5, 0.8):
        cut = tmp_path / "profile.yaml"
        cut.write_text(text[: int(len(text) * fraction)])
        with pytest.raises(InputFileError) as caught:
            load_profile(cut)
        assert str(caught.value).startswith(f"{cut}: ") and "\n" not in str(caught.value)
        result = CliRunner().invoke(cli, ["search", "--gpus", "2", "--hardware", "l4-24gb"])
        _no_traceback(result)
        assert result.exit_code == 1 and "profile.yaml: " in result.output
    assert load_profile(tmp_path / "full.yaml").name  # the whole file still loads


def test_json_errors_name_the_file_and_position(tmp_path):
    path = tmp_path / "meta.json"
    path.write_text('{"step": 3, "ranks": [')
    with pytest.raises(InputFileError, match=r"meta.json: not valid JSON at line 1, column \d+"):
        load_json(path, "checkpoint metadata")


def _plan_needing(tmp_path: Path, host_bytes: int, worker_bytes: int = 0) -> Path:
    raw = yaml.safe_load(EXAMPLE_PLAN.read_text())
    raw["prediction"] = {
        "step_time_s": 0.03,
        "tokens_per_s": 1000.0,
        "tflops_per_gpu": 0.01,
        "mfu": 0.01,
        "peak_gpu_bytes": worker_bytes,
        "peak_host_bytes": host_bytes,
    }
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_a_plan_bigger_than_this_nodes_memory_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    plan = _plan_needing(tmp_path, 1 << 50)  # 1 PiB
    result = CliRunner().invoke(run_command, [str(plan), str(WORKER), "--out", str(out)])
    _no_traceback(result)
    assert result.exit_code == 1
    assert "cannot run here: host memory: plan needs 1048576.00 GiB per node" in result.output
    assert "--force" in result.output
    assert not list(out.iterdir())


def test_a_cpu_plans_workers_count_against_host_memory(tmp_path):
    """A cpu plan's workers live in host memory, and its prediction puts their peak in peak_gpu_bytes with the host
    peak at 0: a plan of 2 x 1 PiB per worker passed --dry-run on any machine."""
    plan = _plan_needing(tmp_path, 0, worker_bytes=1 << 50)
    result = CliRunner().invoke(run_command, ["--dry-run", str(plan), str(WORKER)])
    _no_traceback(result)
    assert result.exit_code == 1, result.output
    assert "host memory: plan needs 2097152.00 GiB per node (2 worker(s) x 1048576.00 GiB)" in result.output
    small = _plan_needing(tmp_path, 0, worker_bytes=1 << 20)
    result = CliRunner().invoke(run_command, ["--dry-run", str(small), str(WORKER)])
    assert result.exit_code == 0 and "ok host memory: plan needs 0.00 GiB per node (2 worker(s) x" in result.output


def test_force_runs_it_with_a_warning(tmp_path):
    plan = _plan_needing(tmp_path, 1 << 50)
    result = CliRunner().invoke(run_command, ["--force", "--dry-run", str(plan), str(WORKER)])
    assert result.exit_code == 0, result.output
    assert "warn host memory: plan needs" in result.output


def _alias_bomb(levels: int = 9) -> str:
    """Nine anchors, each a list of nine aliases of the one before: 9**9 values once expanded."""
    lines = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\nschema_version: 1\n"


@pytest.mark.parametrize("command", ["validate", "show", "search-profile", "search-hardware"])
def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, command):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())
    args = {
        "validate": ["validate", str(bomb)],
        "show": ["show", str(bomb)],
        "search-profile": ["search", "--gpus", "2", "--profile", str(bomb)],
        "search-hardware": ["search", "--gpus", "2", "--hardware", str(bomb), "--profile", str(bomb)],
    }[command]
    result = CliRunner().invoke(cli, args)
    _no_traceback(result)
    assert result.exit_code != 0 and "aliases expand to more than 1,000,000 values" in result.output
    # Aliases within reason still load (PyYAML's dumper writes them for shared lists).
    small = tmp_path / "small.yaml"
    small.write_text(_alias_bomb(levels=3))
    assert load_yaml(small, "plan")["l2"][0][0] == ["x"] * 9
