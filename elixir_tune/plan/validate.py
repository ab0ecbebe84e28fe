"""Plan validation: every problem, each with its field path.

Validation runs on the plain mapping read from YAML, before any dataclass is built, so that a
malformed plan gives the full list of what is wrong instead of the first exception. Field types,
choices and bounds come from the dataclasses of ``plan/schema.py`` (through ``plan/fields.py``);
this module adds the rules that relate several fields.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from elixir_tune.plan.capabilities import (
    LOOP_CONTRACT,
    expert_parallel_conflicts,
    expert_parallel_limits,
    frozen_layout_problem,
    is_expert_param,
    layout_reasons_of_type,
    needs_forward_backward,
    selective_conflicts,
)
from elixir_tune.plan.context import context_degree, context_problems
from elixir_tune.plan.engine_choice import engine_problems
from elixir_tune.plan.fields import check_fields, is_required, section_type
from elixir_tune.plan.memory import ALIGN_ELEMENTS
from elixir_tune.plan.schema import SCHEMA_VERSION, Plan
from elixir_tune.plan.stages import assign_stages, schedule_problem
from elixir_tune.plan.tensor_layout import MODULE_STYLES, grid_problem, unknown_styles

_SECTIONS = [field for field in dataclasses.fields(Plan) if field.name != "schema_version"]


def _check_chunks(chunks: list[dict | None], chunk_size: int | None, path: str, errors: list[str]) -> None:
    """Rules across a plan's chunks: numbering, fit in the chunk size, each parameter once."""
    owner: dict[str, int] = {}
    for index, chunk in enumerate(chunks):
        if chunk is None:
            continue  # not a mapping: already reported
        chunk_path = f"{path}[{index}]"
        if chunk.get("id") is not None and chunk["id"] != index:
            errors.append(f"{chunk_path}.id: expected {index} (chunks are numbered in order), got {chunk['id']}")
        numel = chunk.get("numel")
        if numel is not None and chunk_size is not None and numel > chunk_size:
            errors.append(f"{chunk_path}.numel: {numel} elements do not fit in memory.chunk_size {chunk_size}")
        for name in chunk.get("params", []):
            if name is None:
                continue
            if name in owner:
                errors.append(f"{chunk_path}.params: parameter {name!r} is already in chunk {owner[name]}")
            else:
                owner[name] = index
        if "params" in chunk and not chunk["params"]:
            errors.append(f"{chunk_path}.params: a chunk must hold at least one parameter")


def _check_lora(model: dict, chunks: list[dict], errors: list[str]) -> None:
    """``model.lora``: the settings ``elixir_tune.models.lora.lora_settings`` records, and frozen chunks with them."""
    lora = model.get("lora") or {}
    if not isinstance(lora, dict) or not lora:
        return
    expected = {"rank", "alpha", "dropout", "target_modules"}
    if set(lora) != expected:
        errors.append(f"model.lora: expected the keys {sorted(expected)}, got {sorted(lora)}")
        return
    rank, alpha, dropout, targets = lora["rank"], lora["alpha"], lora["dropout"], lora["target_modules"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        errors.append(f"model.lora.rank: a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        errors.append(f"model.lora.alpha: a positive number, got {alpha!r}")
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        errors.append(f"model.lora.dropout: a number in [0, 1), got {dropout!r}")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        errors.append(f"model.lora.target_modules: a non-empty list of module names, got {targets!r}")
    if chunks and not any(chunk.get("frozen") for chunk in chunks):
        errors.append("model.lora is set but no chunk is frozen: a LoRA plan keeps its base in frozen chunks")
    if chunks and all(chunk.get("frozen") for chunk in chunks):
        errors.append("memory.chunks: every chunk is frozen; the adapters need chunks that are trained")


def _check_foreign_reads(model: dict, chunks: list[dict], errors: list[str]) -> None:
    """``model.foreign_reads``: each module once, each parameter a chunked one of this plan."""
    chunked = {name for chunk in chunks for name in chunk.get("params", []) if isinstance(name, str)}
    seen: set[str] = set()
    for index, read in enumerate(model.get("foreign_reads", [])):
        if not isinstance(read, dict):
            continue  # not a mapping: already reported
        path = f"model.foreign_reads[{index}]"
        module = read.get("module")
        if isinstance(module, str):
            if module in seen:
                errors.append(f"{path}.module: {module!r} is listed twice; list each reading module once")
            seen.add(module)
        params = [name for name in read.get("params", []) if isinstance(name, str)]
        if "params" in read and not read["params"]:
            errors.append(f"{path}.params: empty; list the parameters the module reads, or drop the entry")
        unknown = [name for name in params if chunks and name not in chunked]
        if unknown:
            errors.append(
                f"{path}.params: {unknown[:3]} are in none of memory.chunks (only trainable, chunked parameters "
                "are listed); run `elixir-tune profile` and `elixir-tune search` again"
            )


def _check_parallel(parallel: dict, world_size: int | None, model: dict, errors: list[str]) -> int | None:
    """Rules of the ``parallel`` section; returns the data-parallel size (None when unknown)."""
    stages = parallel.get("pipeline", {}).get("stages", 1)
    tensor = parallel.get("tensor", {})
    degree = tensor.get("degree", 1)
    context = context_degree(parallel)
    if world_size is None:
        return None
    if world_size % (stages * degree * context):
        of_context = f" x context degree {context}" if context > 1 else ""
        errors.append(
            f"parallel: pipeline stages {stages} x tensor degree {degree}{of_context} = {stages * degree * context} "
            f"does not divide the world size {world_size} (cluster.nodes x cluster.gpus_per_node); pick degrees "
            "whose product divides it"
        )
        return None
    num_blocks = model.get("num_blocks", 0)
    if stages > 1 and stages > num_blocks:
        errors.append(
            f"parallel.pipeline.stages: {stages} stages but the model has {num_blocks} repeated blocks "
            "(model.num_blocks); a stage needs at least one block"
        )
    if tensor.get("mode") == "2d" and (degree < 4 or math.isqrt(degree) ** 2 != degree):
        errors.append(
            f"parallel.tensor.degree: mode 2d needs a square degree q x q of at least 4 (2 x 2), got {degree}"
        )
    return world_size // (stages * degree * context)


def _check_tensor(tensor: dict, model: dict, training: dict, errors: list[str]) -> None:
    """Rules of ``parallel.tensor`` that depend on the model and the batch shape."""
    degree = tensor.get("degree", 1)
    if not isinstance(degree, int) or degree <= 1:
        return
    mode = tensor.get("mode", "1d")
    # 1d splits the heads by T; 2d by q over the grid columns (and the micro-batch by q over its rows).
    parts = math.isqrt(degree) if mode == "2d" else degree
    for key in ("num_heads", "num_kv_heads"):
        heads = model.get(key, 0)
        if heads and heads % parts:
            split = f"{degree}" if mode == "1d" else f"{degree} (2d: the heads split {parts} ways)"
            errors.append(
                f"parallel.tensor.degree: {split} does not divide model.{key} {heads}; "
                "each tensor rank needs whole attention heads"
            )
    recorded = model.get("tensor_layout")
    no_grid = grid_problem(recorded) if mode == "2d" and isinstance(recorded, dict) else ""
    if no_grid:
        errors.append(f"parallel.tensor.mode: {no_grid}")
    micro = training.get("micro_batch_size")
    if mode == "2d" and isinstance(micro, int) and micro % parts:
        errors.append(
            f"training.micro_batch_size: {micro} is not a multiple of {parts}; 2d tensor parallelism splits each "
            f"micro-batch over the {parts} rows of its grid"
        )
    seq_len = training.get("seq_len")
    if mode == "1d" and tensor.get("sequence_parallel", True) and isinstance(seq_len, int) and seq_len % degree:
        errors.append(
            f"training.seq_len: {seq_len} is not a multiple of the tensor degree {degree}; sequence parallelism "
            "splits every sample's tokens over the tensor ranks (set parallel.tensor.sequence_parallel: false, "
            "or pick a seq_len that divides)"
        )


def _check_expert(
    parallel: dict, model: dict, training: dict, chunks: list, data_size: int | None, errors: list[str]
) -> None:
    """Rules of ``parallel.expert``: the model ships an expert plan whose experts the degree divides,
    the degree divides the data size, and nothing beside it that the engine does not run with it
    (``capabilities.expert_parallel_conflicts``)."""
    degree = parallel.get("expert", {}).get("degree", 1)
    if not isinstance(degree, int) or degree <= 1:
        return
    path = f"parallel.expert.degree: {degree}"
    experts = model.get("num_experts", 0)
    if not experts:
        errors.append(
            f"{path}, but the model ships no expert plan (model.num_experts is 0: its config has no "
            "base_model_ep_plan dispatching tokens to experts); set it to 1"
        )
    elif isinstance(experts, int) and experts % degree:
        errors.append(
            f"{path} does not divide the model's {experts} experts per block; pick a degree that divides them"
        )
    if data_size and data_size % degree:
        errors.append(
            f"{path} does not divide the data-parallel size {data_size}; the experts are spread over groups of "
            "data ranks, pick a degree that divides it"
        )
    stages = parallel.get("pipeline", {}).get("stages", 1)
    tensor = parallel.get("tensor", {}).get("degree", 1)
    offloaded_experts = sum(
        1
        for chunk in chunks
        if isinstance(chunk, dict) and chunk.get("offload") and any(is_expert_param(p) for p in chunk.get("params", []))
    )
    for index, chunk in enumerate(chunks):
        names = chunk.get("params", []) if isinstance(chunk, dict) else []
        if len({is_expert_param(name) for name in names}) > 1:
            errors.append(
                f"memory.chunks[{index}].params: expert tensors beside other parameters; under expert parallelism "
                "the experts need chunks of their own (run `elixir-tune search` again)"
            )
    conflicts = expert_parallel_conflicts(stages, tensor, training.get("accumulation", "standard"), offloaded_experts)
    if conflicts:
        errors.append(
            f"{path} with {', '.join(conflicts)}: the engine does not run expert parallelism beside "
            f"{expert_parallel_limits()} in this version; drop them (or set the expert degree to 1)"
        )


def _check_contract(parallel: dict, model: dict, training: dict, errors: list[str]) -> None:
    """The plan as a contract (plan/capabilities.py): layouts the engine runs for this model, and the
    loop the training script runs."""
    degrees = {
        "pipeline": (parallel.get("pipeline", {}).get("stages", 1), "parallel.pipeline.stages"),
        "tensor": (parallel.get("tensor", {}).get("degree", 1), "parallel.tensor.degree"),
    }
    model_type = model.get("model_type", "")
    # The profile's record when the plan carries it; the family's otherwise (a plan written before it).
    recorded = model.get("tensor_layout")
    table: dict[str, str] = recorded if isinstance(recorded, dict) else {}
    # An empty record is a record (the profile found nothing the engine cannot run), not a missing one.
    recorded_reasons = model.get("unsupported_layouts")
    if isinstance(recorded_reasons, dict):
        reasons = recorded_reasons
    else:
        reasons = layout_reasons_of_type(model_type, table) if model_type else {}
    unknown = unknown_styles(table)
    if unknown:
        errors.append(
            f"model.tensor_layout: unknown styles {', '.join(unknown)} (known: {', '.join(MODULE_STYLES)}); "
            "profile the model and search again"
        )
    for layout, (degree, path) in degrees.items():
        if isinstance(degree, int) and degree > 1 and layout in reasons:
            errors.append(
                f"{path}: {degree}, but the engine cannot run {layout} parallelism for this model: "
                f"{reasons[layout]}; set it to 1 (search again without --fix {layout}={degree})"
            )
    loop = training.get("loop")
    stages, tensor_degree = degrees["pipeline"][0], degrees["tensor"][0]
    if loop != "plain" or not isinstance(stages, int) or not isinstance(tensor_degree, int):
        return
    needs = needs_forward_backward(stages, tensor_degree, training.get("accumulation", "standard"))
    if needs:
        errors.append(
            f"training.loop: plain ({LOOP_CONTRACT['plain']}), but {'; '.join(needs)} need a script that runs "
            f"{LOOP_CONTRACT['forward_backward']}; if the script does, set training.loop: forward_backward "
            "(elixir-tune search --loop forward_backward), otherwise search again without these"
        )


# parallel.<section>.<field> of the degrees selective_conflicts takes, in its order.
SELECTIVE_DEGREE_FIELDS = (("pipeline", "stages"), ("tensor", "degree"), ("context", "degree"), ("expert", "degree"))


def _check_selective(parallel: dict, training: dict, errors: list[str]) -> None:
    """Selective checkpointing only beside what the engine runs it with (``capabilities.selective_conflicts``)."""
    if training.get("activation_checkpointing", {}).get("mode") != "selective":
        return
    stages, tensor, context, expert = (parallel.get(name, {}).get(key, 1) for name, key in SELECTIVE_DEGREE_FIELDS)
    if not all(isinstance(degree, int) for degree in (stages, tensor, context, expert)):
        return  # reported by the field checks
    conflicts = selective_conflicts(stages, tensor, context, expert, training.get("accumulation", "standard"))
    if conflicts:
        errors.append(
            f"training.activation_checkpointing.mode: selective with {', '.join(conflicts)}: the engine runs "
            "selective checkpointing with data parallelism and standard accumulation only in this version; "
            "use mode full (drop mode), or drop them"
        )


def _check_chunk_stages(chunks: list[dict], pipeline: dict, model: dict, training: dict, errors: list[str]) -> None:
    """A pipeline plan's chunks: each on one stage, the one ``plan/stages.py`` gives its parameters,
    and a schedule that runs the split and the micro-batches (``schedule_problem``)."""
    stages = pipeline.get("stages", 1)
    assignment = pipeline.get("assignment", "modular")
    num_blocks = model.get("num_blocks", 0)
    schedule = pipeline.get("schedule", "looped_bfs")
    micro_batches = training.get("grad_accum_steps")
    problem = schedule_problem(
        num_blocks, stages, assignment, schedule, micro_batches if isinstance(micro_batches, int) else None
    )
    if problem:
        errors.append(f"parallel.pipeline.schedule: {problem}")
    for index, chunk in enumerate(chunks):
        stage = chunk.get("stage", 0)
        if isinstance(stage, int) and stage >= stages:
            errors.append(
                f"memory.chunks[{index}].stage: {stage}, but parallel.pipeline.stages is {stages} (stages 0 to {stages - 1})"
            )
    if stages == 1 or not 0 < stages <= num_blocks or not model.get("block_list"):
        return  # nothing to split, or already reported
    stage_of: dict[str, int] = {}
    for frozen in (False, True):  # each kind's chunks are in first-use order (frozen chunks: a LoRA base)
        names = [
            name
            for chunk in chunks
            if bool(chunk.get("frozen")) == frozen
            for name in chunk.get("params", [])
            if isinstance(name, str)
        ]
        stage_of.update(assign_stages(names, model["block_list"], num_blocks, stages, assignment))
    for index, chunk in enumerate(chunks):
        found = sorted({stage_of[name] for name in chunk.get("params", []) if name in stage_of})
        if len(found) > 1:
            errors.append(
                f"memory.chunks[{index}].params: parameters of pipeline stages {found} in one chunk "
                f"({assignment} assignment); a chunk holds one stage's parameters: pack each stage's apart"
            )
        elif found and chunk.get("stage", 0) != found[0]:
            errors.append(
                f"memory.chunks[{index}].stage: {chunk.get('stage', 0)}, but its parameters are on stage {found[0]} "
                f"({assignment} assignment of {num_blocks} blocks to {stages} stages)"
            )


def other_file_kind(raw: dict) -> str:
    """What elixir-tune file a mapping is when it is not a plan: a profile or a hardware description, with
    what to do with it; "" otherwise (a plan, or something else that validation describes)."""
    if "schema_version" in raw:
        return ""
    if {"fingerprint", "params", "trace"} <= raw.keys():
        return (
            "this is a profile (written by `elixir-tune profile`), not a plan: make a plan from it with "
            "`elixir-tune search --gpus N --profile FILE`, then give that plan"
        )
    if {"gpu_memory_bytes", "matmul_tflops"} <= raw.keys():
        return (
            "this is a hardware description (written by `elixir-tune probe`), not a plan: search with it, "
            "`elixir-tune search --gpus N --hardware FILE`, then give that plan"
        )
    return ""


def validate_dict(raw: Any) -> list[str]:
    """Lists every problem of a plan given as the mapping read from YAML.

    Args:
        raw: the parsed YAML document.

    Returns:
        One message per problem, each starting with the field path; empty when the plan is valid.
    """
    if not isinstance(raw, dict):
        return [f"plan: expected a mapping at the top level, got {type(raw).__name__}"]
    other = other_file_kind(raw)
    if other:  # one line for the wrong file, not a list of every plan section it lacks
        return [other]
    errors: list[str] = []
    sections = _check_sections(raw, errors)
    cluster, training, memory, model = (sections.get(name, {}) for name in ("cluster", "training", "memory", "model"))
    parallel = sections.get("parallel", {})
    _check_backend(cluster, errors)
    world_size = (
        cluster["nodes"] * cluster["gpus_per_node"] if "nodes" in cluster and "gpus_per_node" in cluster else None
    )
    data_size = _check_parallel(parallel, world_size, model, errors)
    _check_tensor(parallel.get("tensor", {}), model, training, errors)
    _check_contract(parallel, model, training, errors)
    _check_expert(parallel, model, training, memory.get("chunks", []) or [], data_size, errors)
    errors.extend(context_problems(parallel, model, training, with_tensor=True, with_pipeline=True))
    errors.extend(engine_problems(sections.get("engine", {}), memory, parallel))
    _check_selective(parallel, training, errors)
    _check_batch_and_blocks(training, model, data_size, errors)
    _check_memory(memory, parallel, model, training, data_size, errors)
    return errors


def _check_sections(raw: dict, errors: list[str]) -> dict[str, dict]:
    """The schema version and each section's fields; the sections whose fields could be read."""
    version = raw.get("schema_version")
    if version is None:
        errors.append(f"schema_version: missing (this elixir-tune writes {SCHEMA_VERSION})")
    elif version != SCHEMA_VERSION:
        errors.append(
            f"schema_version: unknown version {version!r} (this elixir-tune reads {SCHEMA_VERSION}); "
            "upgrade elixir-tune or search the plan again"
        )
    sections: dict[str, dict] = {}
    for field in _SECTIONS:
        value = raw.get(field.name)
        if value is None:
            if is_required(field):
                errors.append(f"{field.name}: missing section")
            continue
        if not isinstance(value, dict):
            errors.append(f"{field.name}: expected a mapping, got {value!r}")
            continue
        sections[field.name] = check_fields(value, section_type(Plan, field.name), field.name, errors)
    known = [field.name for field in _SECTIONS]
    for name in raw:
        if name != "schema_version" and name not in known:
            errors.append(f"{name}: unknown section (known: schema_version, {', '.join(known)})")
    return sections


def _check_backend(cluster: dict, errors: list[str]) -> None:
    if cluster.get("device") == "cuda" and cluster.get("backend") == "gloo":
        errors.append("cluster.backend: gloo cannot run a cuda plan's collectives efficiently; use nccl")
    if cluster.get("device") == "cpu" and cluster.get("backend") == "nccl":
        errors.append("cluster.backend: nccl needs GPUs; a cpu plan uses gloo")


def _check_batch_and_blocks(training: dict, model: dict, data_size: int | None, errors: list[str]) -> None:
    """The global batch's product, and checkpointing's need for a block list."""
    if data_size and all(k in training for k in ("global_batch_size", "micro_batch_size", "grad_accum_steps")):
        product = training["micro_batch_size"] * training["grad_accum_steps"] * data_size
        if product != training["global_batch_size"]:
            errors.append(
                f"training.global_batch_size: {training['global_batch_size']} is not micro_batch_size "
                f"{training['micro_batch_size']} x grad_accum_steps {training['grad_accum_steps']} x "
                f"data-parallel size {data_size} = {product}"
            )
    every = training.get("activation_checkpointing", {}).get("every", 0)
    if every > 0 and model.get("num_blocks", 0) == 0:
        errors.append(
            "training.activation_checkpointing.every: the model has no repeated blocks "
            "(model.num_blocks is 0) to checkpoint"
        )
    elif every > model.get("num_blocks", every):
        errors.append(
            f"training.activation_checkpointing.every: {every} is more than the model's {model['num_blocks']} "
            "blocks, so no block would be checkpointed; set every to at most model.num_blocks, or 0 for none"
        )
    if training.get("activation_checkpointing", {}).get("mode") == "selective" and every == 0:
        errors.append(
            "training.activation_checkpointing.mode: selective, but every is 0 (no block is checkpointed); "
            "set every to 1 (every block) or k, or drop mode"
        )
    if model.get("num_blocks") and not model.get("block_list"):
        errors.append("model.block_list: missing, but model.num_blocks is set")
    if model.get("block_list") and model.get("num_blocks") == 0:
        errors.append(
            f"model.num_blocks: 0, but model.block_list names {model['block_list']!r}; "
            "set it to the blocks that list holds, as the profile records them"
        )


def _check_memory(
    memory: dict, parallel: dict, model: dict, training: dict, data_size: int | None, errors: list[str]
) -> None:
    """The chunk size against the shard group, the chunks, the cache and the prefetch."""
    # The chunks are sharded over data x context.
    context = context_degree(parallel)
    shard_size = data_size * context if data_size else None
    if shard_size and memory.get("chunk_size") and memory["chunk_size"] % shard_size:
        of_context = f" x context degree {context}" if context > 1 else ""
        errors.append(
            f"memory.chunk_size: {memory['chunk_size']} is not a multiple of the data-parallel size "
            f"{data_size}{of_context}"
        )
    _check_chunks(memory.get("chunks", []), memory.get("chunk_size"), "memory.chunks", errors)
    chunks = [chunk for chunk in memory.get("chunks", []) if chunk is not None]
    _check_chunk_stages(chunks, parallel.get("pipeline", {}), model, training, errors)
    _check_foreign_reads(model, chunks, errors)
    _check_lora(model, chunks, errors)
    stages = parallel.get("pipeline", {}).get("stages", 1)
    degree = parallel.get("tensor", {}).get("degree", 1)
    frozen_problem = frozen_layout_problem(stages, degree, parallel.get("tensor", {}).get("mode", "1d"))
    if any(chunk.get("frozen") for chunk in chunks) and frozen_problem:
        errors.append(f"memory.chunks: {frozen_problem}; search again without that layout")
    if "chunks" in memory and not memory["chunks"]:
        errors.append("memory.chunks: empty; a plan needs at least one chunk")
    _check_cache(memory, chunks, errors)
    if model.get("num_params") and chunks and all("numel" in chunk for chunk in chunks):
        total = sum(chunk["numel"] for chunk in chunks)
        # numel spans the alignment padding between parameters (under ALIGN_ELEMENTS each).
        padding = sum(len(chunk.get("params", [])) for chunk in chunks) * (ALIGN_ELEMENTS - 1)
        if total > model["num_params"] + padding:
            errors.append(f"memory.chunks: hold {total} elements, more than model.num_params {model['num_params']}")


def _check_cache(memory: dict, chunks: list[dict], errors: list[str]) -> None:
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


def validate(plan: Plan | dict) -> list[str]:
    """Lists every problem of a plan.

    Args:
        plan: a Plan, or the mapping read from a plan's YAML.

    Returns:
        One message per problem, each starting with the field path; empty when the plan is valid.
    """
    return validate_dict(plan.to_dict() if isinstance(plan, Plan) else plan)
