"""The model-side modules live in ``elixir_tune.models``: the imports the README and docs/ show are real, and the path
it documented first for LoRA (``elixir_tune.lora``) gives the same functions."""

from __future__ import annotations

import re
from pathlib import Path

import elixir_tune.lora
import elixir_tune.models.lora
from elixir_tune.paths import REPO_DIR

IMPORT = re.compile(r"^\s*(from elixir_tune[\w.]* import [\w, ]+|import elixir_tune[\w.]*)\s*(#.*)?$")


def test_every_import_the_readme_and_docs_show_works():
    pages = [Path(REPO_DIR) / "README.md", *sorted((Path(REPO_DIR) / "docs").rglob("*.md"))]
    lines = [line for page in pages for line in page.read_text().splitlines()]
    imports = [match.group(1) for line in lines if (match := IMPORT.match(line))]
    assert any("elixir_tune.models.lora" in line for line in imports), imports  # the LoRA example's (docs/guides)
    for line in imports:
        exec(line, {})  # raises ImportError for a module or name that is not there


def test_the_first_documented_lora_path_gives_the_same_functions():
    for name in elixir_tune.lora.__all__:
        assert getattr(elixir_tune.lora, name) is getattr(elixir_tune.models.lora, name), name
