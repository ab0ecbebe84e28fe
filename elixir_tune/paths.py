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
