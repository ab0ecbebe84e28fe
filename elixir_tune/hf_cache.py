"""Model names such as ``meta-llama/Llama-2-7b-hf`` resolved from the local Hugging Face cache, never the network.

The profiler (``elixir-tune profile NAME``, a plan's ``model.source``) and the recipes (``--model NAME``) take a
model name wherever they take a model directory: it stands for the newest snapshot of that model in the cache
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), found with ``huggingface_hub``'s
``snapshot_download(..., local_files_only=True)``. A name that is not there is a one-line error saying where it
looked and how to get it. No torch here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# owner/name as the Hub spells it: letters, digits, '-', '_', '.'; exactly one '/'.
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


class ModelNotCachedError(ValueError):
    """A model name is not in the local Hugging Face cache (the message says where it looked)."""


def looks_like_hub_name(spec: str) -> bool:
    """Whether ``spec`` reads as a Hub model name (``owner/name``) rather than a path that exists.

    Args:
        spec: what the user gave as the model.

    Returns:
        True for ``owner/name`` that is not an existing path and has no .py/.yaml suffix.
    """
    if not _HUB_NAME.match(spec) or Path(spec).exists():
        return False
    return Path(spec).suffix not in (".py", ".yaml", ".yml", ".json")


def hub_cache_dir() -> Path:
    """The directory ``huggingface_hub`` keeps downloaded models in, as the environment says now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def cached_model_dir(name: str, revision: str | None = None) -> Path:
    """The local snapshot directory of a Hub model, without touching the network.

    Args:
        name: ``owner/name``.
        revision: a branch, tag or commit the cache has (default: ``main``).

    Returns:
        The snapshot directory (it has the config.json, weights and tokenizer files that were downloaded).

    Raises:
        ModelNotCachedError: huggingface_hub is not installed, or the model (or its config.json) is not cached.
    """
    cache = hub_cache_dir()
    fetch = f"`hf download {name}` (or `huggingface-cli download {name}`) on a machine with network"
    try:
        from huggingface_hub import snapshot_download
    except ImportError as error:
        raise ModelNotCachedError(
            f"{name}: reading a model name from the Hugging Face cache needs huggingface_hub; "
            "pip install 'elixir-tune[hf]', or pass the model's directory"
        ) from error
    try:
        snapshot = Path(snapshot_download(name, revision=revision, cache_dir=str(cache), local_files_only=True))
    except Exception as error:  # LocalEntryNotFoundError, or a malformed cache entry: the same advice
        raise ModelNotCachedError(
            f"{name}: not a directory and not in the local Hugging Face cache ({cache}; set HF_HOME or HF_HUB_CACHE "
            f"if yours is elsewhere); download it with {fetch}, or pass the model's directory"
        ) from error
    if not (snapshot / "config.json").is_file():
        raise ModelNotCachedError(
            f"{name}: the cached snapshot {snapshot} has no config.json; download the whole model with {fetch}"
        )
    return snapshot
