"""configs/ ships inside the package: a wheel built from the checkout holds every model YAML, hardware
preset and the example plan under ``elixir_tune/configs/``, and an install of it outside the checkout (run
from a temporary directory) resolves a bare model name and a hardware preset from there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BUILD_FILES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "MANIFEST.in")

CHECK = """
import elixir_tune, elixir_tune.paths as paths
from elixir_tune.hardware.presets import load_hardware
from elixir_tune.profiler.source import load_model_source
print(elixir_tune.__file__)
print(paths.MODEL_CONFIGS_DIR)
print(load_model_source("gpt2-10b").name)
print(load_hardware("a100-80gb-sxm").name)
"""


def test_a_wheel_carries_configs_and_an_install_resolves_bare_names(tmp_path):
    # Built from a copy of the checkout's build inputs, so the build leaves nothing in the checkout.
    source = tmp_path / "source"
    shutil.copytree(REPO / "elixir_tune", source / "elixir_tune", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "configs", source / "configs")
    for name in BUILD_FILES:
        shutil.copy(REPO / name, source / name)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "-w", str(wheels)], check=True)
    (wheel,) = wheels.glob("elixir_tune-*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("elixir_tune/configs/")}
    expected = {f"elixir_tune/{path.relative_to(REPO)}" for path in (REPO / "configs").rglob("*.yaml")}
    assert expected and expected == shipped

    # Installed into a directory of its own, first on the path; run from a directory with no configs/.
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=run_dir, env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0] == str(site / "elixir_tune" / "__init__.py")
    assert out[1] == str(site / "elixir_tune" / "configs" / "models")
    assert out[2] == "gpt2-10b"
    assert out[3]  # the preset's name, read from the installed YAML
