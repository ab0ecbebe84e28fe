"""Tensor-parallel layout of a model: which modules split, along which dimension (no torch).

A model's **tensor table** maps module path patterns (``*`` stands for one path component, the layer
index) to a style, in the order they are tried (docs/parallel.md):

* ``colwise``: a column-parallel linear (its outputs split; weight dim 0 and bias split);
* ``colwise_gather``: the same, with its output gathered whole afterwards (transformers'
  ``colwise_gather_output``: the code after it needs every head, e.g. a fused q | k | v of unequal
  widths, or a norm over all heads);
* ``rowwise``: a row-parallel linear (its inputs split; weight dim 1; bias replicated);
* ``rowwise_split``: the same, fed a whole input that each rank cuts to its columns
  (``rowwise_split_input``, the partner of ``colwise_gather``);
* ``vocab``: the input embedding or the output head, split by vocabulary rows;
* ``head_norm``: a norm inside the attention that runs on this rank's heads (``q_norm``, ``k_norm``;
  transformers' ``replicated_with_grad_allreduce``): replicated, gradient summed over the tensor group;
* ``norm``: a norm on the residual stream: replicated; with sequence parallelism it runs on sequence
  shards and its gradient is summed over the tensor group;
* ``lora_colwise``, ``lora_rowwise``, ``rowwise_partial``, ``replicated_linear``: a PEFT model's LoRA
  layers and their parts (``elixir_tune/models/lora_layout.py``);
* ``experts``: a mixture-of-experts module holding every expert's weights as 3-D tensors
  (transformers' ``moe_tp_experts``): each rank runs its slice of every expert on all tokens and the
  ranks' outputs are summed; its parameters have entries of their own (parameter paths):
  ``packed_colwise`` (gate | up packed along the output dimension, each half split: a rank holds
  ``[gate_r | up_r]``) and ``rowwise`` (split along the input dimension). The router beside it is
  replicated.

Modules not in the table are replicated. The table comes from the model's own
``config.base_model_tp_plan`` (translated by ``tensor_table``; the profiler records the result, the
plan carries it), or, for a family that ships none, from ``BUILTIN_TABLES`` here in the same format
(GPT-2). The search, the cost model, ``validate`` and the engine read the same table, for 1D and for
2D, whose grid plan is derived from these styles (``grid_problem``: the styles with no grid form;
``grid_replicated``: the weights 2D keeps whole).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Literal, get_args

TensorStyle = Literal["colwise", "rowwise", "vocab", "replicate"]
ModuleStyle = Literal[
    "colwise",
    "colwise_gather",
    "rowwise",
    "rowwise_split",
    "vocab",
    "head_norm",
    "norm",
    "experts",
    "packed_colwise",
    # A PEFT model's LoRA layers (elixir_tune/models/lora_layout.py): the layer itself, and its parts.
    "lora_colwise",
    "lora_rowwise",
    "rowwise_partial",
    "replicated_linear",
]
MODULE_STYLES: tuple[str, ...] = get_args(ModuleStyle)
TensorTable = Mapping[str, str]

# GPT-2 ships no tensor plan: ours, in the same format. Its linears are transformers' Conv1D (weight
# [in, out]: the split dimension is swapped) and c_attn fuses q | k | v (the engine splits each by heads).
BUILTIN_TABLES: dict[str, dict[str, str]] = {
    "gpt2": {
        "transformer.h.*.attn.c_attn": "colwise",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "transformer.wte": "vocab",
        "lm_head": "vocab",
        "transformer.h.*.ln_1": "norm",
        "transformer.h.*.ln_2": "norm",
        "transformer.ln_f": "norm",
    },
}
# Families whose linears store their weight as [in, out] (transformers' Conv1D).
_IN_OUT_WEIGHTS = {"gpt2"}

# transformers' tp-plan styles this engine runs, and ours for each.
HF_STYLES: dict[str, ModuleStyle] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",
    "rowwise_split_input": "rowwise_split",
    "embedding_rowwise": "vocab",
    "replicated_with_grad_allreduce": "head_norm",
    "moe_tp_experts": "experts",
    "packed_colwise": "packed_colwise",
}
# Packed parameters hold this many equal tensors along their split dimension (gate | up).
PACKED_PARTS = 2
# transformers 5.25 moved the experts out of ``base_model_tp_plan`` into ``base_model_ep_plan``, whose
# styles say how experts are dispatched, not how a tensor group splits them. Under tensor parallelism
# the experts split as the earlier tensor plans said: the module's output summed over the group, the
# packed gate | up projection by output columns, the down projection by input rows.
EP_DISPATCH_STYLE = "ep_dispatch_experts"
EP_GROUPED_TENSOR_STYLES = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}


def with_expert_entries(tp_plan: Mapping[str, str] | None, ep_plan: Mapping[str, str] | None) -> dict[str, str]:
    """The tensor plan with the experts' entries, for transformers releases that keep them elsewhere.

    Releases up to 5.24 place the experts in the tensor plan itself (``moe_tp_experts``); from 5.25 the
    tensor plan leaves them out and only the expert plan names them. Either layout gives one table.

    Args:
        tp_plan: ``base_model_tp_plan`` (None when the family ships none).
        ep_plan: ``base_model_ep_plan`` (None when the family has no experts).

    Returns:
        The tensor plan, plus ``moe_tp_experts`` for each module the expert plan dispatches to and a
        split style for each of its grouped tensors (a tensor of another name keeps ``grouped_gemm``,
        which ``tensor_table`` refuses by name), unless the tensor plan places experts already.
    """
    merged = dict(tp_plan or {})
    if not ep_plan or "moe_tp_experts" in merged.values():
        return merged
    for pattern, style in ep_plan.items():
        if style == EP_DISPATCH_STYLE:
            merged.setdefault(pattern, "moe_tp_experts")
        elif style == "grouped_gemm":
            merged.setdefault(pattern, EP_GROUPED_TENSOR_STYLES.get(pattern.rpartition(".")[2], style))
    return merged


def supported_model_types() -> tuple[str, ...]:
    """The families with a built-in table (they ship no ``base_model_tp_plan``); every other family
    runs tensor parallelism from its own plan (``tensor_table``)."""
    return tuple(sorted(BUILTIN_TABLES))


def has_table(model_type: str, recorded: TensorTable | None = None) -> bool:
    """Whether a model has a tensor table: a recorded one, or its family's built-in one."""
    return bool(recorded) or model_type in BUILTIN_TABLES


def table_for(model_type: str, recorded: TensorTable | None = None) -> TensorTable:
    """The tensor table to use: the recorded one (from the model's plan), else the family's built-in one.

    Raises:
        ValueError: neither exists (the message says what to do).
    """
    if recorded:
        return recorded
    if model_type in BUILTIN_TABLES:
        return BUILTIN_TABLES[model_type]
    raise ValueError(
        f"no tensor-parallel table for model type {model_type!r}: its profile or plan records none "
        f"(built-in tables: {', '.join(supported_model_types())}); profile the model again with this "
        "version, or use tensor degree 1"
    )


@lru_cache(maxsize=256)
def _pattern(pattern: str) -> re.Pattern[str]:
    return re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))


def module_style(module_path: str, table: TensorTable) -> str | None:
    """The style of the module at ``module_path`` (None: not in the table, replicated)."""
    for pattern, style in table.items():
        if _pattern(pattern).fullmatch(module_path):
            return style
    return None


def _param_role(param_name: str, table: TensorTable) -> tuple[TensorStyle, bool]:
    """(the parameter's split role, whether its gradient is summed over the tensor group)."""
    own = module_style(param_name, table)  # an entry for the parameter itself (the experts' tensors)
    if own in ("packed_colwise", "rowwise"):
        return ("colwise" if own == "packed_colwise" else "rowwise"), False
    module, _, attr = param_name.rpartition(".")
    style = module_style(module, table)
    if style in ("colwise", "colwise_gather", "vocab"):
        return ("vocab" if style == "vocab" else "colwise"), False
    if style == "replicated_linear":  # a LoRA layer's replicated adapter: its gradient is a partial sum
        return "replicate", True
    if style in ("rowwise", "rowwise_split", "rowwise_partial"):
        # A row-parallel bias is added once after the reduction; with sequence parallelism its
        # gradient, like a norm's, is a partial sum over the sequence shards.
        return ("rowwise", False) if attr == "weight" else ("replicate", True)
    return "replicate", style in ("norm", "head_norm")


def tensor_style(param_name: str, model_type: str, table: TensorTable | None = None) -> TensorStyle:
    """The 1D tensor-parallel role of a parameter.

    Args:
        param_name: the parameter's dotted name.
        model_type: the model family (``ModelInfo.model_type``).
        table: the model's tensor table (empty or None: the family's built-in one).

    Returns:
        ``colwise``, ``rowwise``, ``vocab`` or ``replicate``.

    Raises:
        ValueError: no table for this model.
    """
    return _param_role(param_name, table_for(model_type, table))[0]


def is_norm_param(param_name: str, model_type: str, table: TensorTable | None = None) -> bool:
    """Whether a parameter is replicated with a gradient summed over the tensor group (the norms and
    row-parallel biases: with sequence parallelism, one all-reduce over the tensor group per
    micro-batch). False for a model without a table."""
    try:
        return _param_role(param_name, table_for(model_type, table))[1]
    except ValueError:
        return False


def split_dim(param_name: str, shape: list[int], model_type: str, table: TensorTable | None = None) -> int | None:
    """The dimension 1D tensor parallelism splits a parameter along (None: replicated)."""
    style = tensor_style(param_name, model_type, table)
    if style == "replicate":
        return None
    if style == "vocab" or len(shape) == 1:
        return 0
    in_out = model_type in _IN_OUT_WEIGHTS
    # nn.Linear weights are [out, in] (the experts' [experts, out, in]): column-parallel splits out,
    # row-parallel in.
    out_dim, in_dim = len(shape) - 2, len(shape) - 1
    if style == "colwise":
        return in_dim if in_out else out_dim
    return out_dim if in_out else in_dim


def packed_parts(param_name: str, table: TensorTable) -> int:
    """How many equal tensors a parameter packs along its split dimension (1: not packed)."""
    return PACKED_PARTS if module_style(param_name, table) == "packed_colwise" else 1


# 1D styles with no 2D (grid) form, and what they hold: 2D runs each attention and MLP on its own
# samples and heads with every matrix split over the grid; a mixture's experts route every token on
# every rank (their tensors are 3-D, split along one dimension only).
NO_GRID_STYLES: dict[str, str] = {
    "experts": "mixture-of-experts experts",
    "packed_colwise": "packed expert tensors",
}


def grid_problem(table: TensorTable) -> str:
    """Why 2D (grid) tensor parallelism cannot run a model with this tensor table ("" when it can).

    Every other 1D style has a grid form (docs/parallel.md): column-parallel linears enter a
    region (attention or MLP) run on this rank's samples and heads, row-parallel ones leave it, the
    vocabulary split, the residual-stream norms and the per-head norms follow.
    """
    styles = sorted({style for style in table.values() if style in NO_GRID_STYLES})
    if not styles:
        return ""
    held = ", ".join(f"{style} ({NO_GRID_STYLES[style]})" for style in styles)
    return f"2d tensor parallelism has no grid form for the tensor plan's style {held}; use tensor mode 1d"


def _region_patterns(table: TensorTable) -> set[str]:
    """The attention and MLP regions: the parents of the column-parallel linears (patterns)."""
    return {p.rpartition(".")[0] for p, style in table.items() if style in ("colwise", "colwise_gather")}


def in_region(module_path: str, table: TensorTable) -> bool:
    """Whether a module lies inside an attention or MLP region of the table (under the parent of a
    column-parallel linear): 2D runs it on this rank's samples, as an ordinary tensor."""
    return any(re.match(_pattern(region).pattern + "\\.", module_path) for region in _region_patterns(table) if region)


def grid_replicated(param_name: str, table: TensorTable) -> bool:
    """Whether 2D keeps a replicated parameter whole on every rank: a per-head norm, or a parameter
    of an unplaced module inside a region (OLMo2's q_norm), which sees this rank's samples only and
    gets its gradient summed over the grid. Other replicated parameters (the residual-stream norms,
    row-parallel biases) are split by the hidden dimension over the grid columns."""
    module = param_name.rpartition(".")[0]
    style = module_style(module, table)
    return style == "head_norm" or (style is None and in_region(module, table))


def local_shape(
    param_name: str,
    shape: list[int],
    model_type: str,
    degree: int,
    mode: str = "1d",
    table: TensorTable | None = None,
) -> list[int]:
    """The shape of one tensor rank's piece of a parameter.

    Args:
        param_name: the parameter's dotted name.
        shape: its full shape.
        model_type: the model family.
        degree: tensor degree T (q x q for 2d).
        mode: ``1d`` splits the role's dimension by T; ``2d`` splits every dimension of a split
            parameter by q = sqrt(T), and the hidden dimension of replicated ones by q (Optimus
            keeps no full copy of a layer's weights on any rank), but for those ``grid_replicated``
            keeps whole.
        table: the model's tensor table (empty or None: the family's built-in one).

    Returns:
        The local shape.

    Raises:
        ValueError: the split dimension does not divide by the degree, or no table for this model.
    """
    if degree == 1:
        return list(shape)
    local = list(shape)
    packed = 1  # a packed parameter's halves are split each: its dimension divides by packed x parts
    if mode == "1d":
        dims = [] if (dim := split_dim(param_name, shape, model_type, table)) is None else [dim]
        parts = degree
        packed = packed_parts(param_name, table_for(model_type, table))
    else:
        parts = int(round(degree**0.5))
        split = tensor_style(param_name, model_type, table) != "replicate"
        if split:
            dims = list(range(len(shape)))
        else:
            dims = [] if grid_replicated(param_name, table_for(model_type, table)) else [len(shape) - 1]
    for dim in dims:
        if local[dim] % (parts * packed):
            raise ValueError(
                f"{param_name}: dimension {dim} of shape {list(shape)} does not divide by {parts * packed} "
                f"(tensor degree {degree}, mode {mode}); pick a tensor degree that divides it"
            )
        local[dim] //= parts
    return local


def unknown_styles(table: TensorTable) -> list[str]:
    """``pattern: style`` for each entry of a table whose style is not one of ``MODULE_STYLES``."""
    return [f"{pattern}: {style}" for pattern, style in table.items() if style not in MODULE_STYLES]


def moe_blocks(table: TensorTable, paths: Iterable[str]) -> set[str]:
    """The mixture-of-experts blocks among ``paths``: the parents of the modules of style ``experts``."""
    return {path.rpartition(".")[0] for path in paths if module_style(path, table) == "experts"}


def _moe_problem(model_type: str, table: TensorTable, modules: list[tuple[str, str, bool]], regions: set[str]) -> str:
    """Why the engine cannot run a plan's mixture-of-experts entries ("" when it can, or has none).

    It runs a block holding a router and the experts: the experts' packed and row-parallel tensors
    (parameter entries under an ``experts`` entry); a packed style elsewhere, or split linears beside
    the experts in the same block (shared experts, whose output would need its own reduction), are
    refused.
    """
    experts = {pattern for pattern, style in table.items() if style == "experts"}
    misplaced = [p for p, style in table.items() if style == "packed_colwise" and p.rpartition(".")[0] not in experts]
    if misplaced:
        return (
            f"model type {model_type!r}: its tensor plan packs gate | up outside a mixture-of-experts module "
            f"({', '.join(misplaced)}), which the engine does not run yet"
        )
    blocks = moe_blocks(table, (path for path, _, _ in modules))
    beside = sorted(
        path
        for path, _, _ in modules
        if module_style(path, table) in ("colwise", "colwise_gather", "rowwise", "rowwise_split")
        and any(path.startswith(f"{block}.") for block in blocks)
    )
    if beside or blocks & regions:
        return (
            f"model type {model_type!r}: split linears beside the experts in a mixture-of-experts block "
            f"({', '.join(beside[:3]) or ', '.join(sorted(blocks & regions)[:3])}; shared experts) are not run yet"
        )
    return ""


def _generic(path: str) -> str:
    """A module path with its numeric components (layer indices) as ``*``."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def tensor_table(
    model_type: str,
    tp_plan: Mapping[str, str] | None,
    base_prefix: str,
    modules: Iterable[tuple[str, str, bool]],
    embeddings: tuple[str, str],
) -> tuple[dict[str, str], str]:
    """A model's tensor table, translated from its transformers ``base_model_tp_plan``.

    The plan names the base model's linears (patterns relative to it); this adds the base prefix,
    the vocabulary split of the input embedding and the output head (transformers keeps those in the
    causal LM's own plan), and the norms on the residual stream (which sequence parallelism runs on
    sequence shards). A style this engine does not run (the mixture-of-experts styles, packed or
    local ones, ...) makes the whole table unusable: a half-split model is never offered.

    Args:
        model_type: the model's family.
        tp_plan: ``type(config).base_model_tp_plan`` (None when the family ships none).
        base_prefix: the base model's attribute in the causal LM (``model``; "" for a base model).
        modules: (path, class name, has own parameters) of every module of the model.
        embeddings: the paths of the input embedding and of the output head ("" when none).

    Returns:
        (the table, "") or ({}, why tensor parallelism cannot run this model).
    """
    if not tp_plan:
        if model_type in BUILTIN_TABLES:
            return dict(BUILTIN_TABLES[model_type]), ""
        return {}, (
            f"model type {model_type!r} ships no tensor plan (config.base_model_tp_plan) and has no built-in "
            "table: tensor parallelism needs a tensor plan for the model's family"
        )
    refused = sorted({f"{style} ({pattern})" for pattern, style in tp_plan.items() if style not in HF_STYLES})
    prefix = f"{base_prefix}." if base_prefix else ""
    table: dict[str, str] = {f"{prefix}{pattern}": HF_STYLES.get(style, style) for pattern, style in tp_plan.items()}
    input_embedding, output_head = embeddings
    for path in (input_embedding, output_head):
        if path and module_style(path, table) is None:
            table[path] = "vocab"
    modules = list(modules)
    # The regions whose input is gathered whole: the parents of the column-parallel linears, and the
    # mixture-of-experts blocks (the parents of the experts, beside their replicated router).
    regions = {
        path.rpartition(".")[0] for path, _, _ in modules if module_style(path, table) in ("colwise", "colwise_gather")
    }
    # The experts' layout first: its reason stays the same whichever new styles a release adds beside it.
    moe_problem = _moe_problem(model_type, table, modules, regions)
    if moe_problem:
        return {}, moe_problem
    if refused:
        return {}, (
            f"model type {model_type!r}: its tensor plan uses styles the engine does not run yet: {', '.join(refused)}"
        )
    regions |= moe_blocks(table, (path for path, _, _ in modules))
    loose = []
    for path, class_name, has_params in modules:
        if not has_params or module_style(path, table) is not None:
            continue
        if any(path.startswith(f"{region}.") for region in regions):
            continue  # replicated inside an attention or MLP: the plan said when its gradient needs a sum
        if "norm" in class_name.lower():
            table.setdefault(_generic(path), "norm")
        else:
            loose.append(f"{path} ({class_name})")
    if loose:
        return {}, (
            f"model type {model_type!r}: modules on the residual stream that its tensor plan does not place: "
            f"{', '.join(sorted(loose)[:3])}"
        )
    return table, ""
