"""`elixir-tune profile`: output file, JSON, and a clear error with exit status for each user mistake."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from elixir_tune.cli.main import cli
from elixir_tune.paths import MODEL_CONFIGS_DIR
from elixir_tune.profiler import load_profile

MODELS = Path(__file__).resolve().parent.parent / "unit" / "models"


def run(*args):
    return CliRunner().invoke(cli, ["profile", *args])


def test_writes_profile_and_prints_table(tmp_path):
    out = tmp_path / "p.yaml"
    result = run(str(MODEL_CONFIGS_DIR / "gpt2-tiny.yaml"), "--batch-size", "2", "--seq-len", "32", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "124,672" in result.output and "transformer.h" in result.output and f"wrote {out}" in result.output
    profile = load_profile(out)
    assert profile.batch_size == 2 and profile.seq_len == 32 and profile.trace_checkpointed == []


def test_json_and_checkpointing_all(tmp_path):
    out = tmp_path / "p.yaml"
    result = run(
        "gpt2-tiny", "-b", "2", "-s", "32", "--dtype", "bf16", "--checkpointing", "all", "--out", str(out), "--json"
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["num_params"] == 124_672 and summary["shared_params"] == ["transformer.wte.weight"]
    assert summary["dtype"] == "bf16" and summary["num_blocks"] == 2
    assert summary["trace_checkpointed_steps"] > summary["trace_steps"]
    assert load_profile(out).fingerprint == summary["fingerprint"]


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["missing_model.py"], 1, "missing_model.py: no such file"),
        ([str(MODELS / "no_builder.py")], 1, "no builder function build_model()"),
        ([str(MODELS / "raising_builder.py")], 1, "width 7 is not divisible by 2 heads"),
        ([str(MODELS / "no_loss.py")], 1, "did not return a loss"),
        ([str(MODELS / "bad_arch.yaml")], 1, "unknown architecture 'gpt9000'"),
        (["gpt2-tiny", "--dtype", "int8"], 2, "'int8' is not one of"),
    ],
)
def test_errors_are_messages_with_exit_status(args, code, message, tmp_path):
    result = run(*args, "--out", str(tmp_path / "p.yaml"))
    assert result.exit_code == code, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (bytes(range(256)) * 4, "is a binary file, not a model YAML"),
        (b"\xdb\xff garbage " * 50, "is not UTF-8 text (byte 0xdb at offset 0); not a model YAML"),
        (b"architecture: [gpt2\n", "YAML syntax error at line 2, column 1"),
    ],
)
def test_a_model_yaml_that_is_no_yaml_is_one_line(tmp_path, content, message):
    """The profiler read model YAMLs with its own yaml.safe_load: random bytes ended in a UnicodeDecodeError."""
    model = tmp_path / "model.yaml"
    model.write_bytes(content)
    result = run(str(model), "--out", str(tmp_path / "p.yaml"))
    assert result.exit_code == 1, result.output
    assert f"{model}: {message}" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: seconds
def test_console_script_runs(tmp_path):
    script = Path(sys.executable).parent / "elixir-tune"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "elixir_tune.cli.main"]
    proc = subprocess.run(
        [
            *command,
            "profile",
            str(MODELS / "tiny_mlp.py:build_deep"),
            "-b",
            "2",
            "-s",
            "8",
            "--out",
            str(tmp_path / "p.yaml"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["num_blocks"] == 5
