"""`elixir-tune export`: each target's file from the example plan, and the list of what it cannot express."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from click.testing import CliRunner

from elixir_tune.cli.main import cli
from elixir_tune.paths import CONFIGS_DIR

EXAMPLE = str(CONFIGS_DIR / "plans" / "example.yaml")


def _export(tmp_path, target: str, *extra: str):
    out = tmp_path / f"out.{target}"
    result = CliRunner().invoke(cli, ["export", EXAMPLE, "--to", target, "-o", str(out), *extra])
    assert result.exit_code == 0, result.output
    return out.read_text(), result.output


def test_deepspeed_export_writes_zero3_and_lists_the_cache(tmp_path):
    text, output = _export(tmp_path, "deepspeed")
    config = json.loads(text)
    assert config["zero_optimization"]["stage"] == 3
    assert "not expressed" in output and "chunk cache" in output


def test_fsdp2_export_writes_a_setup_file(tmp_path):
    text, _ = _export(tmp_path, "fsdp2")
    compile(text, "fsdp2_setup.py", "exec")  # a valid Python file
    assert "def apply_plan(model, mesh=None)" in text and "fully_shard(" in text


def test_accelerate_export_asks_for_the_block_class(tmp_path):
    text, output = _export(tmp_path, "accelerate")
    config = yaml.safe_load(text)
    assert config["fsdp_config"]["fsdp_version"] == 2 and config["distributed_type"] == "FSDP"
    assert "--block-class" in output
    text, output = _export(tmp_path, "accelerate", "--block-class", "GPT2Block")
    assert yaml.safe_load(text)["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "GPT2Block"
    assert "--block-class" not in output


def test_export_refuses_an_invalid_plan(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: 1\n")
    result = CliRunner().invoke(cli, ["export", str(bad), "--to", "deepspeed"])
    assert result.exit_code != 0 and "not a valid plan" in result.output


def test_export_json_says_what_was_written_and_never_writes_over_the_plan(tmp_path):
    out = tmp_path / "ds.json"
    result = CliRunner().invoke(cli, ["export", EXAMPLE, "--to", "deepspeed", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["out"] == str(out) and report["target"] == "deepspeed" and out.is_file()
    assert any("chunk cache" in note for note in report["not_expressed"])
    plan = tmp_path / "plan.yaml"
    plan.write_text(Path(EXAMPLE).read_text())
    result = CliRunner().invoke(cli, ["export", str(plan), "--to", "deepspeed", "-o", str(plan)])
    assert result.exit_code == 2 and "is the file given as PLAN" in result.output
    assert plan.read_text() == Path(EXAMPLE).read_text()
