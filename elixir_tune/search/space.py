"""The search space: pinned choices (``--fix KEY=VALUE``) and the grids of free ones."""

from __future__ import annotations

import math
from typing import Any, get_args

from elixir_tune.plan.engine_choice import ENGINE_NAMES
from elixir_tune.plan.memory import ALIGN_ELEMENTS
from elixir_tune.plan.schema import (
    ACCUMULATIONS,
    CHECKPOINT_MODES,
    DTYPES,
    PIPELINE_ASSIGNMENTS,
    TENSOR_MODES,
    ContextMode,
)

FIX_KEYS = {
    "chunk_size": "elements per chunk (a multiple of the world size, at least the largest parameter)",
    "cache_blocks": "gathered chunks held at once, an integer or 'all'",
    "offload": "fraction of chunks whose shards live on the host, 0..1",
    "prefetch": "chunks fetched ahead, an integer",
    "micro_batch_size": "samples per micro-batch on one rank",
    "checkpointing": "none, all, every:<k>, selective (every block, torchtitan's per-op policy) or selective:<k>",
    "checkpoint_mode": "full or selective: what a checkpointed block keeps (checkpointing=selective sets it)",
    "dtype": "fp32, bf16 or fp16",
    "accumulation": "standard or layered (micro-batches run layer by layer)",
    "pipeline": "pipeline stages P, an integer (1: none)",
    "assignment": "blocks to pipeline stages: modular (block i on stage i mod P, the default) or contiguous",
    "schedule": "pipeline schedule: looped_bfs or 1f1b (one run of blocks per stage, at least P micro-batches)",
    "tensor": "tensor-parallel degree T, an integer dividing the GPUs of a node and the heads (1: none)",
    "tensor_mode": "1d (Megatron) or 2d (Optimus, square T >= 4)",
    "expert": "expert degree E, an integer dividing the data-parallel size and the experts per block (1: none)",
    "context": "context degree C: each rank computes 1/C of every sequence (1: none)",
    "context_mode": "how a context group exchanges keys and values: ulysses (C divides the heads), allgather or ring",
    "engine": "who runs the plan: elixir (our chunk engine), fsdp2 or deepspeed (data parallelism only)",
}
ALL = "all"
CONTEXT_MODES: tuple[str, ...] = get_args(ContextMode)
# Pipeline schedules the search offers (``search/layouts.py``): the cost model prices what each
# stage holds under them (``costmodel/parallel.py`` ``held_activation_copies``).
SEARCH_SCHEDULES = ("looped_bfs", "1f1b")
# Checkpointing options the search tries when the model has blocks: none, all, every 2nd, every 4th.
CHECKPOINTING_CHOICES = (0, 1, 2, 4)
# Prefetch depths the search tries (each capped by the room the cache leaves).
PREFETCH_CHOICES = (1, 2, 4)
# Offload shares the search tries besides the smallest one that fits.
OFFLOAD_GRID = 16


def _int(key: str, value: Any, minimum: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--fix {key}={value}: expected an integer") from None
    if isinstance(value, float) and value != number or number < minimum:
        raise ValueError(f"--fix {key}={value}: expected an integer >= {minimum}")
    return number


def parse_checkpointing(value: Any) -> int:
    """Checkpointing as the plan's ``every``: none -> 0, all -> 1, every:k -> k (an int passes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"--fix checkpointing={value}: expected none, all or every:<k>")
        return value
    text = str(value).strip().lower()
    if text == "none":
        return 0
    if text == "all":
        return 1
    if text.startswith("every:"):
        return _int("checkpointing", text.split(":", 1)[1], 1)
    raise ValueError(f"--fix checkpointing={value}: expected none, all or every:<k>")


# Pinned keys whose value is one of a list: the list, whether the value is lower-cased first, and
# an optional message (after "--fix key=value: ") when it is not in the list.
_CHOICES: dict[str, tuple[tuple[str, ...], bool, str]] = {
    "checkpoint_mode": (CHECKPOINT_MODES, False, ""),
    "accumulation": (ACCUMULATIONS, False, ""),
    "assignment": (PIPELINE_ASSIGNMENTS, False, ""),
    "schedule": (
        SEARCH_SCHEDULES,
        False,
        f"the search prices {' and '.join(SEARCH_SCHEDULES)}; a plan may name the others (gpipe, "
        "interleaved_1f1b) by hand",
    ),
    "engine": (ENGINE_NAMES, False, ""),
    "context_mode": (CONTEXT_MODES, True, ""),
    "tensor_mode": (TENSOR_MODES, True, ""),
    "dtype": (DTYPES, False, ""),
}


def _choice(key: str, value: Any) -> str:
    choices, lower, message = _CHOICES[key]
    text = str(value).lower() if lower else str(value)
    if text not in choices:
        raise ValueError(f"--fix {key}={value}: {message or 'expected one of ' + ', '.join(choices)}")
    return text


def _pairs(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """KEY=VALUE strings as a mapping; a key pinned twice to different values is refused, not the last kept."""
    pairs: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--fix {item}: expected KEY=VALUE (keys: {', '.join(FIX_KEYS)})")
        key, value = (part.strip() for part in item.split("=", 1))
        if pairs.get(key, value) != value:
            raise ValueError(f"--fix {key} is given twice ({pairs[key]} and {value}); pin it once")
        pairs[key] = value
    return pairs


def parse_fixed(fixed: dict[str, Any] | list[str] | None) -> dict[str, Any]:
    """Normalises pinned choices.

    Args:
        fixed: a mapping (Python callers) or KEY=VALUE strings (the command line).

    Returns:
        Mapping with typed values: chunk_size, prefetch, micro_batch_size ints; cache_blocks an int
        or "all"; offload a float; checkpointing an int ``every``; dtype a string.

    Raises:
        ValueError: an unknown key or a bad value (the message names the key and what it accepts).
    """
    if fixed is None:
        return {}
    if isinstance(fixed, (list, tuple)):
        fixed = _pairs(fixed)
    out: dict[str, Any] = {}
    for key, value in fixed.items():
        if key not in FIX_KEYS:
            raise ValueError(f"--fix {key}: unknown key (known: {', '.join(FIX_KEYS)})")
        if key in ("chunk_size", "micro_batch_size", "pipeline", "tensor", "expert", "context"):
            out[key] = _int(key, value, 1)
        elif key == "prefetch":
            out[key] = _int(key, value, 0)
        elif key == "cache_blocks":
            out[key] = ALL if str(value).strip().lower() == ALL else _int(key, value, 1)
        elif key == "offload":
            try:
                share = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"--fix offload={value}: expected a fraction between 0 and 1") from None
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"--fix offload={value}: expected a fraction between 0 and 1")
            out[key] = share
        elif key == "checkpointing":
            text = str(value).strip().lower()
            if text.startswith("selective"):  # selective[:k]: checkpointing all (or every k), selectively
                out["checkpoint_mode"] = "selective"
                value = "all" if text == "selective" else f"every{text[len('selective') :]}"
            out[key] = parse_checkpointing(value)
        elif key in _CHOICES:
            out[key] = _choice(key, value)
        else:
            raise AssertionError(key)  # every key of FIX_KEYS is handled above
    return out


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def chunk_size_grid(largest_numel: int, trainable_numel: int, world_size: int) -> list[int]:
    """Chunk sizes to try: from the largest parameter up, by factors of about 1.5, up to 8x it or
    the whole model, each a multiple of the world size times the alignment (times 1024 elements
    when that is small next to the chunk), so that shards stay aligned."""
    align = world_size * (1024 if largest_numel >= 1024 * 1024 else ALIGN_ELEMENTS)
    smallest = round_up(largest_numel, align)
    largest = max(smallest, min(8 * smallest, round_up(trainable_numel, align)))
    sizes = []
    size = float(smallest)
    while size < largest:
        sizes.append(round_up(int(size), align))
        size *= 1.5
    sizes.append(largest)
    return sorted(set(sizes))


def even_split_sizes(largest_numel: int, trainable_numel: int, world_size: int) -> list[int]:
    """Chunk sizes that split the trainable elements into n nearly equal chunks, for every n whose
    size lies within the grid's range (``chunk_size_grid``): the candidates for sizes with little
    padding, where the grid's 1.5x steps can leave a third of each chunk empty
    (``layout.least_padded_sizes`` picks among them).

    Args:
        largest_numel: the largest trainable parameter (the smallest allowed chunk).
        trainable_numel: trainable elements of the whole model.
        world_size: data-parallel ranks.

    Returns:
        The sizes, ascending, each a multiple of the shard alignment.
    """
    grid = chunk_size_grid(largest_numel, trainable_numel, world_size)
    align = world_size * (1024 if largest_numel >= 1024 * 1024 else ALIGN_ELEMENTS)
    smallest, largest = grid[0], grid[-1]
    sizes = set()
    for chunks in range(max(1, trainable_numel // largest), trainable_numel // max(1, smallest) + 2):
        size = round_up(-(-trainable_numel // chunks), align)
        if smallest <= size <= largest:
            sizes.add(size)
    return sorted(sizes)


def cache_grid(minimum: int, cacheable: int) -> list[int]:
    """Cache sizes to try: the smallest, a few above it, then growing by about 1.5x up to every
    non-resident chunk (ZeRO-2-like)."""
    if cacheable <= minimum:
        return [max(cacheable, minimum)]
    values = {minimum, min(minimum + 1, cacheable), min(minimum + 2, cacheable), cacheable}
    size = float(minimum + 2)
    while size < cacheable:
        values.add(int(math.ceil(size)))
        size *= 1.5
    return sorted(v for v in values if minimum <= v <= cacheable)


def divisors(number: int) -> list[int]:
    """Positive divisors of ``number``, ascending."""
    return [d for d in range(1, number + 1) if number % d == 0]
