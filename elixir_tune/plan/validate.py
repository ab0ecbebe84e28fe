"""Plan validation: every problem, each with its field path.

Validation runs on the plain mapping read from YAML, before any dataclass is built, so that a
malformed plan gives the full list of what is wrong instead of the first exception.
"""

from __future__ import annotations

from typing import Any

from elixir_tune.plan.memory import ALIGN_ELEMENTS
from elixir_tune.plan.schema import BACKENDS, DEVICES, DTYPES, MODEL_STATE_KEYS, SCHEMA_VERSION, Plan

# Field tables: name -> (accepted python types, required). bool is excluded from int explicitly.
_INT, _NUM, _STR, _BOOL, _LIST, _MAP = (int,), (int, float), (str,), (bool,), (list,), (dict,)

_SECTIONS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "model": {
        "source": (_STR, True),
        "fingerprint": (_STR, True),
        "num_params": (_INT, True),
        "name": (_STR, False),
        "block_list": (_STR, False),
        "num_blocks": (_INT, False),
    },
    "cluster": {
        "hardware": (_STR, True),
        "nodes": (_INT, True),
        "gpus_per_node": (_INT, True),
        "device": (_STR, True),
        "backend": (_STR, True),
    },
    "training": {
        "dtype": (_STR, True),
        "global_batch_size": (_INT, True),
        "micro_batch_size": (_INT, True),
        "grad_accum_steps": (_INT, True),
        "seq_len": (_INT, True),
        "activation_checkpointing": (_MAP, False),
    },
    "memory": {
        "chunk_size": (_INT, True),
        "cache_blocks": (_INT, True),
        "prefetch": (_INT, True),
        "chunks": (_LIST, True),
        "staging_buffers": (_INT, False),
    },
    "prediction": {
        "step_time_s": (_NUM, True),
        "tokens_per_s": (_NUM, True),
        "tflops_per_gpu": (_NUM, True),
        "mfu": (_NUM, True),
        "peak_gpu_bytes": (_INT, True),
        "peak_host_bytes": (_INT, True),
        "model_state_bytes": (_MAP, False),
        "transient_bytes": (_MAP, False),
        "breakdown": (_MAP, False),
    },
    "search": {
        "strategy": (_STR, True),
        "candidates": (_INT, True),
        "elapsed_s": (_NUM, True),
        "alternatives": (_LIST, False),
    },
}
_OPTIONAL_SECTIONS = ("prediction", "search")
_CHUNK_FIELDS = {
    "id": (_INT, True),
    "params": (_LIST, True),
    "numel": (_INT, True),
    "resident": (_BOOL, False),
    "offload": (_BOOL, False),
}
_POSITIVE = {
    "model.num_params",
    "cluster.nodes",
    "cluster.gpus_per_node",
    "training.global_batch_size",
    "training.micro_batch_size",
    "training.grad_accum_steps",
    "training.seq_len",
    "memory.chunk_size",
    "memory.staging_buffers",
}
_NON_NEGATIVE = {
    "model.num_blocks",
    "memory.cache_blocks",
    "memory.prefetch",
    "prediction.step_time_s",
    "prediction.tokens_per_s",
    "prediction.tflops_per_gpu",
    "prediction.mfu",
    "prediction.peak_gpu_bytes",
    "prediction.peak_host_bytes",
    "search.candidates",
    "search.elapsed_s",
}


def _type_name(types: tuple[type, ...]) -> str:
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "true or false",
        list: "a list",
        dict: "a mapping",
    }
    return " or ".join(names[t] for t in types if not (t is int and float in types))


def _is_instance(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False
    return isinstance(value, types)


def _check_fields(mapping: dict, table: dict, path: str, errors: list[str]) -> dict:
    """Checks presence, types and signs; returns the fields that are well typed."""
    good = {}
    for name, (types, required) in table.items():
        field_path = f"{path}.{name}"
        if name not in mapping or mapping[name] is None:
            if required:
                errors.append(f"{field_path}: missing (expected {_type_name(types)})")
            continue
        value = mapping[name]
        if not _is_instance(value, types):
            errors.append(f"{field_path}: expected {_type_name(types)}, got {value!r}")
            continue
        if field_path in _POSITIVE and value <= 0:
            errors.append(f"{field_path}: must be positive, got {value}")
            continue
        if field_path in _NON_NEGATIVE and value < 0:
            errors.append(f"{field_path}: must not be negative, got {value}")
            continue
        good[name] = value
    for name in mapping:
        if name not in table:
            errors.append(f"{path}.{name}: unknown field (known: {', '.join(table)})")
    return good


def _check_choice(value: Any, choices: tuple[str, ...], path: str, errors: list[str]) -> None:
    if value is not None and value not in choices:
        errors.append(f"{path}: unknown value {value!r} (expected one of {', '.join(choices)})")


def _check_chunks(chunks: list, memory: dict, path: str, errors: list[str]) -> list[dict]:
    good_chunks = []
    owner: dict[str, int] = {}
    chunk_size = memory.get("chunk_size")
    for index, chunk in enumerate(chunks):
        chunk_path = f"{path}[{index}]"
        if not isinstance(chunk, dict):
            errors.append(f"{chunk_path}: expected a mapping, got {chunk!r}")
            continue
        fields = _check_fields(chunk, _CHUNK_FIELDS, chunk_path, errors)
        if fields.get("id") is not None and fields["id"] != index:
            errors.append(f"{chunk_path}.id: expected {index} (chunks are numbered in order), got {fields['id']}")
        numel = fields.get("numel")
        if numel is not None and numel <= 0:
            errors.append(f"{chunk_path}.numel: must be positive, got {numel}")
        elif numel is not None and chunk_size is not None and numel > chunk_size:
            errors.append(f"{chunk_path}.numel: {numel} elements do not fit in memory.chunk_size {chunk_size}")
        for name in fields.get("params", []):
            if not isinstance(name, str):
                errors.append(f"{chunk_path}.params: expected parameter names, got {name!r}")
            elif name in owner:
                errors.append(f"{chunk_path}.params: parameter {name!r} is already in chunk {owner[name]}")
            else:
                owner[name] = index
        if "params" in fields and not fields["params"]:
            errors.append(f"{chunk_path}.params: a chunk must hold at least one parameter")
        good_chunks.append(fields)
    return good_chunks


def validate_dict(raw: Any) -> list[str]:
    """Lists every problem of a plan given as the mapping read from YAML.

    Args:
        raw: the parsed YAML document.

    Returns:
        One message per problem, each starting with the field path; empty when the plan is valid.
    """
    if not isinstance(raw, dict):
        return [f"plan: expected a mapping at the top level, got {type(raw).__name__}"]
    errors: list[str] = []
    version = raw.get("schema_version")
    if version is None:
        errors.append(f"schema_version: missing (this elixir-tune writes {SCHEMA_VERSION})")
    elif version != SCHEMA_VERSION:
        errors.append(
            f"schema_version: unknown version {version!r} (this elixir-tune reads {SCHEMA_VERSION}); "
            "upgrade elixir-tune or search the plan again"
        )
    sections: dict[str, dict] = {}
    for name, table in _SECTIONS.items():
        value = raw.get(name)
        if value is None:
            if name not in _OPTIONAL_SECTIONS:
                errors.append(f"{name}: missing section")
            continue
        if not isinstance(value, dict):
            errors.append(f"{name}: expected a mapping, got {value!r}")
            continue
        sections[name] = _check_fields(value, table, name, errors)
    for name in raw:
        if name not in _SECTIONS and name != "schema_version":
            errors.append(f"{name}: unknown section (known: schema_version, {', '.join(_SECTIONS)})")

    cluster = sections.get("cluster", {})
    training = sections.get("training", {})
    memory = sections.get("memory", {})
    model = sections.get("model", {})
    _check_choice(cluster.get("device"), DEVICES, "cluster.device", errors)
    _check_choice(cluster.get("backend"), BACKENDS, "cluster.backend", errors)
    if cluster.get("device") == "cuda" and cluster.get("backend") == "gloo":
        errors.append("cluster.backend: gloo cannot run a cuda plan's collectives efficiently; use nccl")
    if cluster.get("device") == "cpu" and cluster.get("backend") == "nccl":
        errors.append("cluster.backend: nccl needs GPUs; a cpu plan uses gloo")
    _check_choice(training.get("dtype"), DTYPES, "training.dtype", errors)

    world_size = None
    if "nodes" in cluster and "gpus_per_node" in cluster:
        world_size = cluster["nodes"] * cluster["gpus_per_node"]
    if world_size and all(k in training for k in ("global_batch_size", "micro_batch_size", "grad_accum_steps")):
        product = training["micro_batch_size"] * training["grad_accum_steps"] * world_size
        if product != training["global_batch_size"]:
            errors.append(
                f"training.global_batch_size: {training['global_batch_size']} is not micro_batch_size "
                f"{training['micro_batch_size']} x grad_accum_steps {training['grad_accum_steps']} x "
                f"data-parallel size {world_size} = {product}"
            )
    checkpointing = training.get("activation_checkpointing")
    if checkpointing is not None:
        every = checkpointing.get("every", 0)
        if not _is_instance(every, _INT) or every < 0:
            errors.append(
                f"training.activation_checkpointing.every: expected 0 (none), 1 (all) or k > 1, got {every!r}"
            )
        elif every > 0 and model.get("num_blocks", 0) == 0:
            errors.append(
                "training.activation_checkpointing.every: the model has no repeated blocks "
                "(model.num_blocks is 0) to checkpoint"
            )
        for name in checkpointing:
            if name != "every":
                errors.append(f"training.activation_checkpointing.{name}: unknown field (known: every)")
    if model.get("num_blocks") and not model.get("block_list"):
        errors.append("model.block_list: missing, but model.num_blocks is set")

    if world_size and memory.get("chunk_size") and memory["chunk_size"] % world_size:
        errors.append(f"memory.chunk_size: {memory['chunk_size']} is not a multiple of the world size {world_size}")
    chunks = _check_chunks(memory.get("chunks", []), memory, "memory.chunks", errors)
    if "chunks" in memory and not memory["chunks"]:
        errors.append("memory.chunks: empty; a plan needs at least one chunk")
    cacheable = sum(1 for chunk in chunks if not chunk.get("resident", False))
    if "cache_blocks" in memory and "chunks" in memory:
        if memory["cache_blocks"] > cacheable:
            errors.append(
                f"memory.cache_blocks: {memory['cache_blocks']} is more than the {cacheable} non-resident chunks"
            )
        elif memory["cache_blocks"] == 0 and cacheable > 0:
            errors.append("memory.cache_blocks: 0, but non-resident chunks need at least one cache block")
    if "prefetch" in memory and "cache_blocks" in memory and memory["prefetch"] >= max(memory["cache_blocks"], 1):
        if memory["prefetch"] > 0:
            errors.append(
                f"memory.prefetch: {memory['prefetch']} must be smaller than memory.cache_blocks "
                f"{memory['cache_blocks']} (prefetched chunks need room beside the one in use)"
            )
    if model.get("num_params") and chunks and all("numel" in chunk for chunk in chunks):
        total = sum(chunk["numel"] for chunk in chunks)
        # numel spans the alignment padding between parameters (under ALIGN_ELEMENTS each).
        padding = sum(len(chunk.get("params", [])) for chunk in chunks) * (ALIGN_ELEMENTS - 1)
        if total > model["num_params"] + padding:
            errors.append(f"memory.chunks: hold {total} elements, more than model.num_params {model['num_params']}")

    states = sections.get("prediction", {}).get("model_state_bytes", {})
    for key in states:
        if key not in MODEL_STATE_KEYS:
            errors.append(f"prediction.model_state_bytes.{key}: unknown key (known: {', '.join(MODEL_STATE_KEYS)})")
    return errors


def validate(plan: Plan | dict) -> list[str]:
    """Lists every problem of a plan.

    Args:
        plan: a Plan, or the mapping read from a plan's YAML.

    Returns:
        One message per problem, each starting with the field path; empty when the plan is valid.
    """
    if isinstance(plan, Plan):
        from elixir_tune.plan.io import plan_to_dict

        plan = plan_to_dict(plan)
    return validate_dict(plan)
