"""Where a PEFT (LoRA) model keeps its base model, its parameters' names, and the tensor-table entries
of its LoRA layers.

No torch import (duck-typed, like ``stage_plans.py`` and ``tensor_table.py``, which use it): the
profiler and the engine read the same answers.

A PEFT model wraps the causal LM (``base_model.model.`` in front of every path) and replaces each
adapted linear by a LoRA layer holding the frozen ``base_layer`` and the adapters ``lora_A.<name>``
(in -> r) and ``lora_B.<name>`` (r -> out); its output is ``base_layer(x) + lora_B(lora_A(x)) x scale``.
The stage plan and the tensor table are the causal LM's, under that prefix; for tensor
parallelism each LoRA layer's entry becomes entries for its parts (docs/finetune-data.md):

* a column-parallel base (``colwise``, ``colwise_gather``): the base and ``lora_B`` split their
  outputs alike, ``lora_A`` is replicated (it reads the whole input) with its gradient summed over
  the tensor group (``replicated_linear``);
* a row-parallel base (``rowwise``): the base and ``lora_A`` split their inputs and leave partial
  sums (``rowwise_partial``), ``lora_B`` is replicated and maps ``lora_A``'s partial sums to partial
  sums (linear), and the LoRA layer reduces base + adapter once over the tensor group
  (``lora_rowwise``), as the base alone would be reduced.
"""

from __future__ import annotations

import re
from typing import Any

from elixir_tune.plan.tensor_layout import module_style

# PEFT's default adapter name: its parameters are ``...lora_A.default.weight``.
ADAPTER_NAME = "default"
PEFT_PREFIX = "base_model.model."
_ADAPTER_PART = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)(\.|$)")
# Styles a LoRA layer's base may have under tensor parallelism, and its parts' entries for each.
_COLWISE_PARTS = {"colwise": "colwise", "colwise_gather": "colwise_gather"}


def peft_base(model: Any) -> tuple[Any, str]:
    """(the model a PEFT model wraps, its path prefix); ``(model, "")`` for any other model.

    Args:
        model: an ``nn.Module``; a PEFT model has ``peft_config`` and ``get_base_model``.
    """
    get_base = getattr(model, "get_base_model", None)
    if not isinstance(getattr(model, "peft_config", None), dict) or not callable(get_base):
        return model, ""
    base = get_base()
    path = next((name for name, module in model.named_modules() if module is base and name), "")
    return (base, f"{path}.") if path else (model, "")


def is_adapter_name(name: str) -> bool:
    """A PEFT adapter parameter (``...q_proj.lora_A.default.weight``): in no base checkpoint."""
    return bool(_ADAPTER_PART.search(name))


def base_name(name: str) -> str:
    """A PEFT model's name of a base parameter -> the base model's (the checkpoint's) name.

    ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``; other names are returned as they are.
    """
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".")


def lora_layer_paths(model: Any) -> list[str]:
    """The paths of ``model``'s LoRA layers (modules holding ``base_layer`` and ``lora_A``)."""
    return [
        path
        for path, module in model.named_modules()
        if path and hasattr(module, "base_layer") and hasattr(module, "lora_A")
    ]


def inside_lora_layer(path: str, lora_layers: set[str]) -> bool:
    """Whether the module at ``path`` is a part of one of ``lora_layers`` (its base or an adapter)."""
    parts = path.split(".")
    return any(".".join(parts[:end]) in lora_layers for end in range(1, len(parts)))


def _generic(path: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def lora_tensor_table(
    base_table: dict[str, str], prefix: str, lora_layers: list[str], module_paths: list[str]
) -> tuple[dict[str, str], str]:
    """The tensor table of a PEFT model from its base model's table.

    Args:
        base_table: the wrapped causal LM's table (``tensor_table.model_tensor_table`` of it).
        prefix: the PEFT model's path to it (``base_model.model.``).
        lora_layers: the PEFT model's LoRA layer paths (``lora_layer_paths``).
        module_paths: every module path of the PEFT model.

    Returns:
        (the table, "") or ({}, why tensor parallelism cannot run these adapters).
    """
    table: dict[str, str] = {}
    lora_patterns: dict[str, str] = {}  # generic pattern of a LoRA layer -> its base's style
    for path in lora_layers:
        style = module_style(path.removeprefix(prefix), base_table)
        pattern = _generic(path)
        if style is None:
            continue  # a replicated base: its adapters are replicated too
        if style not in (*_COLWISE_PARTS, "rowwise"):
            return {}, (
                f"LoRA on {path}, a {style!r} module under tensor parallelism, is not run yet; adapt the attention "
                "and MLP linears (e.g. --lora-targets q_proj,v_proj), or use tensor degree 1"
            )
        lora_patterns[pattern] = style
    for pattern, style in lora_patterns.items():
        if style == "rowwise":
            table[pattern] = "lora_rowwise"
            table[f"{pattern}.base_layer"] = "rowwise_partial"
            table[f"{pattern}.lora_A.*"] = "rowwise_partial"
            table[f"{pattern}.lora_B.*"] = "replicated_linear"
        else:
            table[pattern] = "lora_colwise"
            table[f"{pattern}.base_layer"] = _COLWISE_PARTS[style]
            table[f"{pattern}.lora_A.*"] = "replicated_linear"
            table[f"{pattern}.lora_B.*"] = _COLWISE_PARTS[style]
    # Adapters on some layers only (PEFT's layers_to_transform) would need two kinds of entries under
    # one pattern: a layer index in a pattern is always ``*``.
    lora_set = set(lora_layers)
    mixed = sorted(path for path in module_paths if _generic(path) in lora_patterns and path not in lora_set)
    if mixed:
        return {}, (
            f"LoRA adapts {_generic(mixed[0])} in some blocks but not {mixed[0]}; under tensor parallelism adapt "
            "the same modules in every block, or use tensor degree 1"
        )
    adapted = {pattern.removeprefix(prefix) for pattern in lora_patterns}
    for pattern, style in base_table.items():
        if pattern in adapted:
            continue
        table[f"{prefix}{pattern}"] = style
    return table, ""
