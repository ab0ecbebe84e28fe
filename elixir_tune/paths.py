"""Where the project's own files live: configs/ (model YAMLs, hardware presets, the example plan).

An installed package carries them as ``elixir_tune/configs/`` (setup.py copies them in at build time); a
checkout (and an editable install of it) reads ``configs/`` beside the package.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent  # the checkout (scripts and benchmarks only: an install has none)
INSTALLED_CONFIGS_DIR = PACKAGE_DIR / "configs"
CONFIGS_DIR = INSTALLED_CONFIGS_DIR if INSTALLED_CONFIGS_DIR.is_dir() else REPO_DIR / "configs"
MODEL_CONFIGS_DIR = CONFIGS_DIR / "models"
HARDWARE_CONFIGS_DIR = CONFIGS_DIR / "hardware"


def split_model_spec(spec: str) -> tuple[str, str]:
    """A MODEL argument's path and builder: ``model.py:my_builder`` names another builder than
    ``build_model``; any other spec (a YAML, a directory, a Hub name) is its own path.

    Args:
        spec: MODEL as ``elixir-tune profile`` takes it.

    Returns:
        (path part, builder name).
    """
    head, sep, tail = spec.rpartition(":")
    if sep and head.endswith(".py") and tail.isidentifier():
        return head, tail
    return spec, "build_model"
