"""Profiler: builds a model on the meta device and records what the cost model needs.

Public API:
    load_model_source(spec) -> ModelSource   resolve file.py[:builder], model YAML or config name
    check_model_source(spec) -> name         the same checks without importing a Python file (plans are inert)
    profile_model(source, batch_size, seq_len, dtype, checkpointing) -> ModelProfile
    ModelProfile, save_profile, load_profile (schema.py, torch-free)
"""

from elixir_tune.profiler.schema import ActivationLine, BlockInfo, ModelProfile, ParamInfo, load_profile, save_profile

__all__ = [
    "ActivationLine",
    "BlockInfo",
    "ModelProfile",
    "ModelSource",
    "ModelSourceError",
    "ParamInfo",
    "check_model_source",
    "load_model_source",
    "load_profile",
    "profile_model",
    "save_profile",
]


def __getattr__(name: str):
    # torch is imported only when the profiler itself is used, so reading a profile stays light.
    if name in ("ModelSource", "ModelSourceError", "check_model_source", "load_model_source"):
        from elixir_tune.profiler import source

        return getattr(source, name)
    if name == "profile_model":
        from elixir_tune.profiler.profile import profile_model

        return profile_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
