"""Nothing a run does by default goes unsaid (issue "What a newcomer meets"): a recipe started without ``--data``
says that it trains on the bundled demo text, on one CPU worker for one step, and writes the settings it ran with."""

from __future__ import annotations

import argparse

import pytest
import yaml

from elixir_tune.recipes import BUNDLED_TEXT, pretrain
from elixir_tune.recipes.options import bundled_data_note, parse_options
from tests.e2e.launch_helpers import run_elixir, tune

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

BUNDLED_NOTE = "data: the bundled demo text (public_domain.txt); give --data FILE for yours"


def test_a_run_without_data_says_it_trains_on_the_demo_text(tmp_path):
    tune(["profile", "gpt2-tiny", "--batch-size", 2, "--seq-len", 32], tmp_path)
    tune(["search", "--gpus", 1, "--hardware", "cpu", "--global-batch-size", 2], tmp_path)
    result = run_elixir(["plan.yaml", "pretrain", "--steps", 1], timeout_s=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    (start,) = [i for i, line in enumerate(lines) if line.startswith("training gpt2-tiny")]
    assert lines[start + 1] == BUNDLED_NOTE, lines[start : start + 3]
    # The run's settings beside its log (issue's "no file for the run's settings"): --config of it repeats the run.
    written = tmp_path / "runs" / "train.settings.yaml"
    settings = yaml.safe_load(written.read_text())
    assert (settings["steps"], settings["data"], settings["log"]) == (1, str(BUNDLED_TEXT), "runs/train.json")
    again = parse_options(pretrain.build_parser(), ["--config", str(written)], for_preflight=True)
    assert vars(again) == {**vars(parse_options(pretrain.build_parser(), ["--steps", "1"])), "config": str(written)}


def test_data_of_ones_own_or_random_tokens_print_no_such_line(tmp_path):
    mine = tmp_path / "mine.txt"
    mine.write_text("my own words\n")
    assert bundled_data_note(argparse.Namespace(data=str(BUNDLED_TEXT), synthetic=False)) == BUNDLED_NOTE
    assert bundled_data_note(argparse.Namespace(data=str(mine), synthetic=False)) is None
    assert bundled_data_note(argparse.Namespace(data=str(BUNDLED_TEXT), synthetic=True)) is None
    assert bundled_data_note(argparse.Namespace(data=str(BUNDLED_TEXT))) == BUNDLED_NOTE  # finetune has no --synthetic
