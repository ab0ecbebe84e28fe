"""transformers' parallel plans of a model's config, read one way by the profiler and the engine (no torch).

A config class carries ``base_model_tp_plan`` (tensor), ``base_model_ep_plan`` (experts) and others as
class attributes. Some releases empty an instance's copy when transformers itself was asked for no
parallelism, so the class's plan comes first.
"""

from __future__ import annotations

from typing import Any


def config_plan(config: Any, name: str) -> dict[str, Any]:
    """The plan ``name`` of ``config``'s class, else of the instance ({} when neither has one)."""
    if config is None:
        return {}
    return dict(getattr(type(config), name, None) or getattr(config, name, None) or {})
