"""`elixir-tune search --train-tokens`: the answer, the frontier, the plan it writes, and clear errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from elixir_tune.cli.main import cli
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.plan import load_plan, validate
from elixir_tune.profiler.schema import save_profile


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_profile(gpt2_profile("small", hidden=256, layers=8, heads=8, seq_len=512, positions=512), "profile.yaml")
    return tmp_path


def invoke(*args: str):
    return CliRunner().invoke(cli, ["search", "--hardware", "h100-80gb-sxm", *args])


def test_the_answer_names_the_cluster_and_writes_its_plan(workdir):
    result = invoke("--train-tokens", "1B", "--max-gpus", "32", "--loop", "forward_backward", "--gpu-hour-price", "2")
    assert result.exit_code == 0, result.output
    assert "shortest:" in result.output and "GPU-hours" in result.output and "estimate" in result.output
    plan = load_plan(workdir / "plan.yaml")
    assert not validate(plan)
    assert "--train-tokens 1B" in (workdir / "plan.yaml").read_text()


def test_json_has_the_frontier_within_the_limit_and_the_network_flag_slows_it(workdir):
    base = ("--train-tokens", "1e9", "--max-gpus", "32", "--loop", "forward_backward", "--json", "--full-frontier")
    fast = json.loads(invoke(*base).output)
    slow = json.loads(invoke(*base, "--network", "eth-25", "--out", "slow.yaml").output)  # plan.yaml holds fast's
    assert [row["gpus"] for row in fast["frontier"]] == [8, 16, 32]
    assert all(row["batch_tokens"] <= fast["batch_limit"]["tokens"] for row in fast["frontier"])
    assert slow["best"]["days"] >= fast["best"]["days"]
    fixed = json.loads(invoke("--train-tokens", "1e9", "--gpus", "8", "--nodes", "2", "--json", "--force").output)
    assert [row["gpus"] for row in fixed["frontier"]] == [16]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--train-tokens", "lots", "--max-gpus", "8"), "expected a token count"),
        (("--train-tokens", "1e9"), "needs the cluster"),
        (("--train-tokens", "1e9", "--max-gpus", "8", "--batch-limit", "0"), "at least one token"),
        (("--train-tokens", "1e9", "--max-gpus", "8", "--global-batch-size", "999999"), "more than the batch limit"),
        ((), "missing option --gpus"),
    ],
)
def test_bad_input_is_one_clear_line(workdir, args, message):
    result = invoke(*args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output
