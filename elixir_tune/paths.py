"""Where the project's own files live (configs/ beside the package in a checkout)."""

from __future__ import annotations

from pathlib import Path

REPO_DIR = Path(__file__).resolve().parent.parent
CONFIGS_DIR = REPO_DIR / "configs"
MODEL_CONFIGS_DIR = CONFIGS_DIR / "models"
HARDWARE_CONFIGS_DIR = CONFIGS_DIR / "hardware"
