"""Context parallelism's rules (``parallel.context``), shared by ``validate``, the search and the engine.

What this version runs (``CONTEXT_PARALLEL_RUNS_WITH``): Ulysses (all-to-all over heads), the
all-gather form (load-balanced causal split, every rank's K/V gathered) or ring attention (the same
split, K/V passed around the group) on a data x context world, with standard accumulation, the
attention implementations ``sdpa`` and ``eager``, and the families in ``CONTEXT_MODEL_TYPES`` (the
ones whose forward passes its keyword arguments down to the attention function and whose loss is
the plain shifted cross-entropy), beside 1D tensor parallelism (context groups T ranks apart) and
pipeline stages (context groups inside a stage). The composition with 2D tensor and expert
parallelism is refused with the reason. Lifting a limit is a change of its table entry and of the
engine. Imports no torch.
"""

from __future__ import annotations

from typing import Any

# What context parallelism runs beside in this version: False entries are refused by validate.
CONTEXT_PARALLEL_RUNS_WITH: dict[str, bool] = {
    "ring": True,
    "pipeline": True,  # the first stage slices the tokens, later stages pass 1/C of the sequence on
    "tensor": True,  # 1D (Megatron, sequence-parallel norms): each tensor rank's heads over its shard
    "tensor_2d": False,
    "expert": False,
    "layered": False,
}

_LIMIT_REASONS = {
    "ring": "mode ring",
    "pipeline": "pipeline stages",
    "tensor": "tensor parallelism",
    "tensor_2d": "2D tensor parallelism",
    "expert": "expert parallelism",
    "layered": "layered accumulation",
}

# Families whose attention the engine's Ulysses exchange has been checked on (equal to plain
# PyTorch at world 2, fp32). Another family may work but is refused until a test says so.
CONTEXT_MODEL_TYPES = frozenset(
    {"llama", "gpt2", "qwen2", "qwen3", "phi3", "granite", "olmo2", "qwen3_moe", "gemma2", "mixtral", "mistral"}
)


def context_degree(parallel: Any) -> int:
    """The context degree C of a ``parallel`` mapping (1 when absent or malformed)."""
    degree = parallel.get("context", {}).get("degree", 1) if isinstance(parallel, dict) else 1
    return degree if isinstance(degree, int) and degree >= 1 else 1


def context_problems(
    parallel: dict, model: dict, training: dict, with_tensor: bool = False, with_pipeline: bool = False
) -> list[str]:
    """Every reason the engine cannot run the plan's context parallelism, each with its field path.

    Args:
        parallel: the plan's ``parallel`` mapping.
        model: the plan's ``model`` mapping (``model_type``, ``num_heads``, ``num_kv_heads``).
        training: the plan's ``training`` mapping (``seq_len``, ``accumulation``).
        with_tensor: accept 1D tensor parallelism beside C, which the engine runs (``validate``
            passes True). The search leaves it False: its cost model does not price C x T yet, and
            its context layouts carry no tensor degree, so a C x T pin is refused there.
        with_pipeline: accept pipeline stages beside C, which the engine runs (``validate`` passes True;
            the search leaves it False for the same reasons as ``with_tensor``).

    Returns:
        The problems; empty when C is 1 or the plan runs.
    """
    degree = context_degree(parallel)
    if degree == 1:
        return []
    context = parallel.get("context", {})
    tensor = parallel.get("tensor", {}).get("degree", 1)
    path = f"parallel.context.degree: {degree}"
    asked = {
        "ring": context.get("mode", "ulysses") == "ring",
        "pipeline": parallel.get("pipeline", {}).get("stages", 1) > 1,
        "tensor": tensor > 1,
        "tensor_2d": tensor > 1 and parallel.get("tensor", {}).get("mode", "1d") != "1d",
        "expert": parallel.get("expert", {}).get("degree", 1) > 1,
        "layered": training.get("accumulation", "standard") == "layered",
    }
    problems = []
    runs = dict(
        CONTEXT_PARALLEL_RUNS_WITH,
        tensor=CONTEXT_PARALLEL_RUNS_WITH["tensor"] and with_tensor,
        pipeline=CONTEXT_PARALLEL_RUNS_WITH["pipeline"] and with_pipeline,
    )
    conflicts = [_LIMIT_REASONS[key] for key, used in asked.items() if used and not runs[key]]
    if conflicts:
        where = "data x context worlds (the search)"
        if with_tensor or with_pipeline:
            where = (
                f"data x {'pipeline x ' if with_pipeline else ''}context x {'1D tensor ' if with_tensor else ''}worlds"
            )
        problems.append(
            f"{path} with {', '.join(conflicts)}: this version runs context parallelism on {where} with standard "
            "accumulation; drop them or set the context degree to 1"
        )
    model_type = model.get("model_type", "")
    if model_type not in CONTEXT_MODEL_TYPES:
        problems.append(
            f"{path}, but the engine's context parallelism is checked on {', '.join(sorted(CONTEXT_MODEL_TYPES))} "
            f"only, not model_type {model_type or '(unknown)'!r}; set the context degree to 1"
        )
    mode = context.get("mode", "ulysses")
    if mode == "ulysses":
        # Tensor parallelism splits the heads first: Ulysses splits each tensor rank's share again.
        split = degree * tensor if isinstance(tensor, int) and tensor > 1 else degree
        of_tensor = f" x tensor degree {tensor}" if split != degree else ""
        for key in ("num_heads", "num_kv_heads"):
            heads = model.get(key, 0)
            if isinstance(heads, int) and heads and heads % split:
                problems.append(
                    f"{path}{of_tensor} does not divide model.{key} {heads}; Ulysses gives each context rank whole "
                    "attention heads of the full sequence (parallel.context.mode allgather or ring takes any head count)"
                )
    seq_len = training.get("seq_len")
    # Ulysses needs C equal shards; the load-balanced causal split needs 2C (chunks i and 2C-1-i).
    parts = degree if mode == "ulysses" else 2 * degree
    if isinstance(seq_len, int) and seq_len % parts:
        problems.append(
            f"training.seq_len: {seq_len} is not a multiple of {parts}; context parallelism gives each of the "
            f"{degree} context ranks an equal share of every sequence"
        )
    return problems
