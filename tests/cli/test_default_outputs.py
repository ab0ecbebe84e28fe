"""`profile` and `search` without --out write ./profile.yaml and ./plan.yaml; one there that holds another
model's profile or another plan is not replaced unasked (issue "What a newcomer meets": following the README's
commands in order replaced the quick start's plan with a 4096-GPU one, and `elixir-run plan.yaml pretrain`
failed). An identical re-run replaces its file; --out naming it, or --force, replaces any."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from elixir_tune.cli.main import cli
from elixir_tune.plan import load_plan
from elixir_tune.profiler import load_profile

QUICK_START = ["search", "--gpus", "2", "--hardware", "cpu", "--global-batch-size", "16"]
TIME_TO_TRAIN = ["search", "--train-tokens", "3.5T", "--max-gpus", "4096", "--hardware", "h100-80gb-sxm"]


def tune(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def quick_start(tmp_path, monkeypatch):
    """The README's quick start in an empty directory: profile.yaml and plan.yaml of the tiny GPT-2."""
    monkeypatch.chdir(tmp_path)
    for args in (["profile", "gpt2-tiny", "--batch-size", "8", "--seq-len", "128"], QUICK_START):
        result = tune(*args)
        assert result.exit_code == 0, result.output
    return tmp_path


def test_the_readme_in_order_keeps_the_quick_start_plan(quick_start):
    plan_file = quick_start / "plan.yaml"
    again = tune(*QUICK_START)  # the same search: its own file, replaced without a word
    assert again.exit_code == 0, again.output
    written = plan_file.read_text()

    refused = tune(*TIME_TO_TRAIN)
    assert refused.exit_code == 2
    message = " ".join(refused.output.split())
    assert (
        "error: plan.yaml holds another plan: gpt2-tiny on 1 x 2 cpu, global batch 16, where this search's is "
        "gpt2-tiny on " in message
    )
    assert "h100-80gb-sxm, global batch" in message and "they differ in cluster" in message
    assert "hint: write it elsewhere with --out other.yaml, or replace plan.yaml with --force" in message
    assert plan_file.read_text() == written

    pinned = tune(*QUICK_START, "--fix", "offload=0.5")  # the same cluster and batch, other settings
    assert pinned.exit_code == 2 and "they differ in memory settings" in " ".join(pinned.output.split())
    assert plan_file.read_text() == written

    assert tune(*TIME_TO_TRAIN, "--out", "run.yaml").exit_code == 0
    assert load_plan(quick_start / "run.yaml").cluster.hardware == "h100-80gb-sxm"
    assert load_plan(plan_file).cluster.hardware == "cpu"
    assert tune(*QUICK_START, "--fix", "offload=0.5", "--out", "plan.yaml").exit_code == 0  # named: replaced
    forced = tune(*TIME_TO_TRAIN, "--force")
    assert forced.exit_code == 0, forced.output
    assert load_plan(plan_file).cluster.hardware == "h100-80gb-sxm"


def test_a_file_that_is_no_plan_is_not_replaced_either(quick_start):
    (quick_start / "plan.yaml").write_text("my notes: [\n")
    refused = tune(*QUICK_START)
    assert refused.exit_code == 2
    assert "error: plan.yaml holds no plan this version reads (YAML syntax error" in refused.output
    assert (quick_start / "plan.yaml").read_text() == "my notes: [\n"


def test_a_profile_of_another_model_is_not_replaced(quick_start):
    profile_file = quick_start / "profile.yaml"
    tiny = load_profile(profile_file)
    refused = tune("profile", "llama-tiny", "--batch-size", "2", "--seq-len", "16")
    assert refused.exit_code == 2
    message = " ".join(refused.output.split())
    assert (
        f"error: profile.yaml holds the profile of gpt2-tiny (fingerprint {tiny.fingerprint}); this one is " in message
    )
    assert "--out other.yaml (and search with --profile other.yaml), or replace profile.yaml with --force" in message
    assert load_profile(profile_file) == tiny

    same_model = tune("profile", "gpt2-tiny", "--batch-size", "2", "--seq-len", "64")  # the same fingerprint
    assert same_model.exit_code == 0, same_model.output
    assert load_profile(profile_file).seq_len == 64
    assert tune("profile", "llama-tiny", "--batch-size", "2", "--seq-len", "16", "--force").exit_code == 0
    assert load_profile(profile_file).name == "llama-tiny"
