"""The build's one hook: configs/ ships inside the package (metadata and settings: setup.cfg, pyproject.toml).

configs/ (model YAMLs, hardware presets, the example plan) stays at the checkout's root, where the README,
scripts and tests name it. A built package (``pip install .``, a wheel, an sdist) gets a copy as
``elixir_tune/configs/``, so that an install outside the checkout resolves bare names (``gpt2-10b``,
``--hardware a100-80gb-sxm``); ``elixir_tune/paths.py`` prefers that copy and falls back to the checkout's
(an editable install has no copy).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"


class BuildPyWithConfigs(build_py):
    """``build_py`` that also copies configs/ into the built package as ``elixir_tune/configs``."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # the checkout's configs/ is read in place
            return
        if not (CONFIGS_DIR / "models").is_dir():
            raise RuntimeError(f"{CONFIGS_DIR} is missing: build from a checkout or an sdist (MANIFEST.in grafts it)")
        shutil.copytree(CONFIGS_DIR, Path(self.build_lib, "elixir_tune", "configs"), dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithConfigs})
