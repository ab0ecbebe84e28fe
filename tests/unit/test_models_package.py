"""The model-side modules live in ``elixir_tune.models``: the README's imports are the real ones, and the path
it documented first for LoRA (``elixir_tune.lora``) gives the same functions."""

from __future__ import annotations

import re
from pathlib import Path

import elixir_tune.lora
import elixir_tune.models.lora
from elixir_tune.paths import REPO_DIR

IMPORT = re.compile(r"^\s*(from elixir_tune[\w.]* import [\w, ]+|import elixir_tune[\w.]*)\s*(#.*)?$")


def test_every_import_the_readme_shows_works():
    lines = (Path(REPO_DIR) / "README.md").read_text().splitlines()
    imports = [match.group(1) for line in lines if (match := IMPORT.match(line))]
    assert any("elixir_tune.models.lora" in line for line in imports), imports  # the LoRA example's
    for line in imports:
        exec(line, {})  # raises ImportError for a module or name that is not there


def test_the_first_documented_lora_path_gives_the_same_functions():
    for name in elixir_tune.lora.__all__:
        assert getattr(elixir_tune.lora, name) is getattr(elixir_tune.models.lora, name), name
