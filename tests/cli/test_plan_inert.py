"""A plan file is inert: reading, explaining and dry-running it runs none of the code it names.

A plan received from someone else names its model by ``model.source``; a Python file there must not be
imported before the user starts the job on purpose. The model file here writes a marker when imported;
``validate``, ``show`` and ``elixir-run --dry-run`` (own script and the pretrain recipe) must leave none.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elixir_tune.paths import REPO_DIR

EXAMPLE_PLAN = REPO_DIR / "configs" / "plans" / "example.yaml"

MARKER_MODEL = """\
import pathlib
pathlib.Path(__file__).with_name("MARKER").write_text("this file was imported")

def build_model():
    import torch
    return torch.nn.Linear(2, 2)

def example_batch(batch_size, seq_len):
    return {}
"""


def _script(name: str) -> str:
    found = Path(sys.executable).parent / name
    return str(found) if found.exists() else (shutil.which(name) or pytest.fail(f"{name} is not installed"))


@pytest.fixture
def marker_plan(tmp_path: Path) -> Path:
    (tmp_path / "model.py").write_text(MARKER_MODEL)
    raw = yaml.safe_load(EXAMPLE_PLAN.read_text())
    raw["model"]["source"] = "model.py"
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(raw, sort_keys=False))
    (tmp_path / "train.py").write_text("raise SystemExit('the training script ran')\n")
    return plan


@pytest.mark.parametrize(
    "command",
    [
        ["elixir-tune", "validate", "plan.yaml"],
        ["elixir-tune", "show", "plan.yaml"],
        ["elixir-tune", "show", "--json", "plan.yaml"],
        ["elixir-run", "--dry-run", "plan.yaml", "./train.py"],
        ["elixir-run", "--dry-run", "plan.yaml", "pretrain", "--synthetic", "--steps", "2"],
        ["elixir-run", "--dry-run", "--json", "plan.yaml", "pretrain", "--synthetic"],
    ],
    ids=lambda command: " ".join(command[:3]),
)
def test_reading_a_plan_imports_nothing_it_names(marker_plan: Path, command: list[str]):
    result = subprocess.run(
        [_script(command[0]), *command[1:]], cwd=marker_plan.parent, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (marker_plan.parent / "MARKER").exists(), f"{' '.join(command)} imported the plan's model.source"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (MARKER_MODEL.replace("def example_batch", "def other_batch"), "no example_batch(batch_size, seq_len)"),
        ("def build_model(:\n", "model.py: not valid Python"),
    ],
)
def test_the_model_file_is_still_checked_without_importing_it(marker_plan: Path, source: str, expected: str):
    (marker_plan.parent / "model.py").write_text(source)
    result = subprocess.run(
        [_script("elixir-run"), "--dry-run", "plan.yaml", "pretrain", "--synthetic"],
        cwd=marker_plan.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (marker_plan.parent / "MARKER").exists()
