"""The plan: what to run, read by the engine and the launcher. Imports no torch."""

from elixir_tune.plan.fingerprint import fingerprint, model_fingerprint
from elixir_tune.plan.io import (
    PLAN_ENV_VAR,
    PlanError,
    dump_plan,
    load_plan,
    plan_from_dict,
    plan_to_dict,
    read_plan_dict,
    save_plan,
)
from elixir_tune.plan.schema import (
    DTYPE_BYTES,
    DTYPES,
    MODEL_STATE_KEYS,
    SCHEMA_VERSION,
    SHARD_BYTES_PER_ELEMENT,
    Checkpointing,
    ChunkPlan,
    ClusterInfo,
    MemoryPlan,
    ModelInfo,
    Plan,
    Prediction,
    SearchInfo,
    TrainingInfo,
)
from elixir_tune.plan.validate import validate, validate_dict

__all__ = [
    "PLAN_ENV_VAR",
    "PlanError",
    "dump_plan",
    "load_plan",
    "plan_from_dict",
    "plan_to_dict",
    "read_plan_dict",
    "save_plan",
    "DTYPE_BYTES",
    "DTYPES",
    "MODEL_STATE_KEYS",
    "SCHEMA_VERSION",
    "SHARD_BYTES_PER_ELEMENT",
    "Checkpointing",
    "ChunkPlan",
    "ClusterInfo",
    "MemoryPlan",
    "ModelInfo",
    "Plan",
    "Prediction",
    "SearchInfo",
    "TrainingInfo",
    "fingerprint",
    "model_fingerprint",
    "validate",
    "validate_dict",
]
