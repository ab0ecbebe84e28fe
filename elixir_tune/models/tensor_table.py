"""A model's tensor table read from the model itself: shared by the profiler (which records it) and
the engine (which uses the plan's record, or this for a plan written before it was recorded).

The translation is ``plan/tensor_layout.py`` ``tensor_table``; this only collects what it needs from
the model (duck-typed: no torch import).
"""

from __future__ import annotations

from typing import Any

from elixir_tune.models.hf_plans import config_plan
from elixir_tune.models.lora_layout import inside_lora_layer, lora_layer_paths, lora_tensor_table, peft_base
from elixir_tune.plan.tensor_layout import BUILTIN_TABLES, module_style, tensor_table, with_expert_entries


def _path_of(model: Any, target: Any) -> str:
    if target is None:
        return ""
    return next((path for path, module in model.named_modules() if module is target), "")


def model_tensor_table(model: Any) -> tuple[dict[str, str], str]:
    """The tensor table of ``model`` from its ``config.base_model_tp_plan`` (or the built-in one).

    Args:
        model: an ``nn.Module``; transformers models carry a ``config``.

    Returns:
        (the table, "") or ({}, why tensor parallelism cannot run this model).
    """
    base, prefix = peft_base(model)
    if prefix:  # a PEFT model: the wrapped model's table, with entries for the LoRA layers' parts
        table, why = model_tensor_table(base)
        if why:
            return {}, why
        model_type = getattr(getattr(base, "config", None), "model_type", "")
        if model_type in BUILTIN_TABLES:  # split by hand-written engine code (GPT-2's Conv1D), not by the table
            return (
                {},
                f"LoRA under tensor parallelism runs families with a transformers tensor plan; {model_type} has none",
            )
        paths = [path for path, _ in model.named_modules()]
        return lora_tensor_table(table, prefix, lora_layer_paths(model), paths)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "") if config is not None else ""
    if not isinstance(model_type, str) or not model_type:
        return {}, "a model without a transformers config has no tensor plan"
    if not hasattr(model, "lm_head"):
        return {}, f"tensor parallelism runs {model_type} causal LMs (with an lm_head) only"
    tp_plan = config_plan(config, "base_model_tp_plan")
    tp_plan = with_expert_entries(tp_plan, config_plan(config, "base_model_ep_plan")) if tp_plan else tp_plan
    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    embeddings = (
        _path_of(model, get_input() if callable(get_input) else None),
        _path_of(model, get_output() if callable(get_output) else None),
    )
    # PEFT puts its LoRA layers inside the model it wraps: their parts are placed by lora_layout.py, the
    # layer itself by its base's entry.
    lora_layers = set(lora_layer_paths(model))
    modules = [
        (path, type(module).__name__, any(True for _ in module.parameters(recurse=False)))
        for path, module in model.named_modules()
        if path and not inside_lora_layer(path, lora_layers)
    ]
    base_prefix = getattr(model, "base_model_prefix", "") or ""
    if base_prefix and not hasattr(model, base_prefix):
        base_prefix = ""
    table, why = tensor_table(model_type, tp_plan, base_prefix, modules, embeddings)
    # The experts' tensors each need an entry of their own (a bias the plan leaves out would be
    # added by every rank to its partial output).
    unplaced = [
        f"{path}.{name}"
        for path, module in model.named_modules()
        if path and module_style(path, table) == "experts"
        for name, _ in module.named_parameters(recurse=False)
        if module_style(f"{path}.{name}", table) not in ("packed_colwise", "rowwise")
    ]
    if unplaced:
        return (
            {},
            f"model type {model_type!r}: expert tensors its tensor plan does not place: {', '.join(unplaced[:3])}",
        )
    return table, why
