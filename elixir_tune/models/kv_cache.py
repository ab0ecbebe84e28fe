"""Transformers' key/value cache off for training: shared by the profiler and the engine."""

from __future__ import annotations

from typing import Any


def disable_kv_cache(model: Any) -> None:
    """Turns off transformers' key/value cache, as its own gradient checkpointing does.

    A training step never reads the cache, and a cache filled during the forward makes a
    checkpointed block's recomputation take another path than its forward (T5's decoder).

    Args:
        model: an ``nn.Module``; every submodule with a ``config.use_cache`` gets it set False.
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            config.use_cache = False
