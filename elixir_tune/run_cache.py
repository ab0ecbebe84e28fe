"""Where ``elixir-tune train`` keeps the profiles and plans it made, so that a second run starts at once.

A profile is keyed by what decides it: the model's files (a directory's ``config.json``, a model file or YAML;
weights never change a profile), the traced batch, sequence length, dtype, LoRA settings and this elixir-tune's
version. A plan is keyed by its profile's bytes, the hardware description's bytes, the workers and the global
batch. Change any of them and a new profile or plan is made; a plan made from a stale model would still be
refused by ``elixir_tune.setup``, which checks the model's real fingerprint. The cache lives in
``$ELIXIR_TUNE_CACHE``, else ``$XDG_CACHE_HOME/elixir-tune``, else ``~/.cache/elixir-tune``. Imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from elixir_tune import __version__
from elixir_tune.paths import MODEL_CONFIGS_DIR, split_model_spec

CACHE_ENV_VAR = "ELIXIR_TUNE_CACHE"
KEY_CHARS = 16  # hex digits of a cache key in a file name


def cache_dir() -> Path:
    """The cache's folder (not created here)."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "elixir-tune"


def model_files(spec: str) -> list[Path]:
    """The files that decide a model's profile: a directory's config.json, a model file, a model YAML (a bare
    config name included), or a cached Hub model's config.json; [] when the spec names none of those.

    Args:
        spec: MODEL as ``elixir-tune profile`` takes it (``file.py:builder`` included).
    """
    path = Path(split_model_spec(spec)[0])
    if path.is_dir():
        return [path / "config.json"] if (path / "config.json").is_file() else []
    if path.is_file():
        return [path]
    named = MODEL_CONFIGS_DIR / f"{spec}.yaml"
    if named.is_file():
        return [named]
    from elixir_tune.hf_cache import ModelNotCachedError, cached_model_dir, looks_like_hub_name

    if looks_like_hub_name(spec):
        try:
            config = cached_model_dir(spec) / "config.json"
        except (ModelNotCachedError, ValueError, OSError):
            return []
        return [config] if config.is_file() else []
    return []


def digest(parts: dict[str, Any], files: list[Path] | None = None) -> str:
    """A key over ``parts`` (JSON-able settings) and the bytes of ``files``.

    Args:
        parts: the settings that decide the cached file.
        files: files whose content decides it too.

    Returns:
        ``KEY_CHARS`` hex digits.
    """
    hasher = hashlib.sha256(json.dumps({"version": __version__, **parts}, sort_keys=True, default=str).encode())
    for path in files or []:
        hasher.update(b"\0" + path.read_bytes())
    return hasher.hexdigest()[:KEY_CHARS]


def profile_path(key: str) -> Path:
    """Where the profile of ``key`` is kept."""
    return cache_dir() / "profiles" / f"profile-{key}.yaml"


def plan_path(key: str) -> Path:
    """Where the plan of ``key`` is kept."""
    return cache_dir() / "plans" / f"plan-{key}.yaml"
