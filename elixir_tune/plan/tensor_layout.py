"""Tensor-parallel layout per model family: which parameters split, along which dimension.

One small table per family (Megatron's 1D roles: column-parallel linears split their outputs,
row-parallel linears their inputs, embeddings and the output head split the vocabulary, the rest is
replicated). The engine parallelizes modules from these roles and the search packs each tensor
rank's local pieces into chunks, so both read the same table; it imports no torch.
"""

from __future__ import annotations

from typing import Literal

TensorStyle = Literal["colwise", "rowwise", "vocab", "replicate"]

# (name suffix, style); the first suffix that matches wins, anything else is replicated.
# transformers' GPT-2 uses Conv1D, whose weight is [in, out]: the split dimension is swapped.
_LLAMA: tuple[tuple[str, TensorStyle], ...] = (
    ("self_attn.q_proj.weight", "colwise"),
    ("self_attn.q_proj.bias", "colwise"),
    ("self_attn.k_proj.weight", "colwise"),
    ("self_attn.k_proj.bias", "colwise"),
    ("self_attn.v_proj.weight", "colwise"),
    ("self_attn.v_proj.bias", "colwise"),
    ("self_attn.o_proj.weight", "rowwise"),
    ("mlp.gate_proj.weight", "colwise"),
    ("mlp.up_proj.weight", "colwise"),
    ("mlp.down_proj.weight", "rowwise"),
    ("embed_tokens.weight", "vocab"),
    ("lm_head.weight", "vocab"),
)
_TABLES: dict[str, tuple[tuple[str, TensorStyle], ...]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "gpt2": (
        ("attn.c_attn.weight", "colwise"),
        ("attn.c_attn.bias", "colwise"),
        ("attn.c_proj.weight", "rowwise"),
        ("mlp.c_fc.weight", "colwise"),
        ("mlp.c_fc.bias", "colwise"),
        ("mlp.c_proj.weight", "rowwise"),
        ("wte.weight", "vocab"),
        ("lm_head.weight", "vocab"),
    ),
}
# The norms' parameters, replicated: under sequence parallelism a norm runs on sequence shards, so
# its gradient is a partial sum over the tensor group.
_LLAMA_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "norm.weight")
_NORMS: dict[str, tuple[str, ...]] = {
    "llama": _LLAMA_NORMS,
    "mistral": _LLAMA_NORMS,
    "qwen2": _LLAMA_NORMS,
    "gpt2": ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "ln_f.weight", "ln_f.bias"),
}
# OPT is left out until the engine has its tensor-parallel adapter (engine/tp_adapters.py): the
# search must never pick a layout the engine refuses.
# Families whose linears store their weight as [in, out] (transformers' Conv1D).
_IN_OUT_WEIGHTS = {"gpt2"}


def supported_model_types() -> tuple[str, ...]:
    """The model families tensor parallelism has a layout for."""
    return tuple(sorted(_TABLES))


def tensor_style(param_name: str, model_type: str) -> TensorStyle:
    """The 1D tensor-parallel role of a parameter.

    Args:
        param_name: the parameter's dotted name.
        model_type: the model family (``ModelInfo.model_type``).

    Returns:
        ``colwise``, ``rowwise``, ``vocab`` or ``replicate``.

    Raises:
        ValueError: no layout for this family.
    """
    if model_type not in _TABLES:
        raise ValueError(
            f"no tensor-parallel layout for model type {model_type!r} "
            f"(supported: {', '.join(supported_model_types())}); use tensor degree 1 for this model"
        )
    for suffix, style in _TABLES[model_type]:
        if param_name.endswith(suffix):
            return style
    return "replicate"


def is_norm_param(param_name: str, model_type: str) -> bool:
    """Whether a parameter belongs to a norm (replicated; with sequence parallelism its gradient is a
    partial sum that is all-reduced over the tensor group once per micro-batch)."""
    return param_name.endswith(_NORMS.get(model_type, ()))


def split_dim(param_name: str, shape: list[int], model_type: str) -> int | None:
    """The dimension 1D tensor parallelism splits a parameter along (None: replicated)."""
    style = tensor_style(param_name, model_type)
    if style == "replicate":
        return None
    if style == "vocab" or len(shape) == 1:
        return 0
    in_out = model_type in _IN_OUT_WEIGHTS
    # nn.Linear weights are [out, in]: column-parallel splits out (dim 0), row-parallel in (dim 1).
    if style == "colwise":
        return 1 if in_out else 0
    return 0 if in_out else 1


def local_shape(param_name: str, shape: list[int], model_type: str, degree: int, mode: str = "1d") -> list[int]:
    """The shape of one tensor rank's piece of a parameter.

    Args:
        param_name: the parameter's dotted name.
        shape: its full shape.
        model_type: the model family.
        degree: tensor degree T (q x q for 2d).
        mode: ``1d`` splits the role's dimension by T; ``2d`` splits every dimension of a split
            parameter by q = sqrt(T), and the hidden dimension of replicated ones by q (Optimus
            keeps no full copy of a layer's weights on any rank).

    Returns:
        The local shape.

    Raises:
        ValueError: the split dimension does not divide by the degree.
    """
    if degree == 1:
        return list(shape)
    local = list(shape)
    if mode == "1d":
        dims = [] if (dim := split_dim(param_name, shape, model_type)) is None else [dim]
        parts = degree
    else:
        parts = int(round(degree**0.5))
        dims = list(range(len(shape))) if tensor_style(param_name, model_type) != "replicate" else [len(shape) - 1]
    for dim in dims:
        if local[dim] % parts:
            raise ValueError(
                f"{param_name}: dimension {dim} of shape {list(shape)} does not divide by {parts} "
                f"(tensor degree {degree}, mode {mode}); pick a tensor degree that divides it"
            )
        local[dim] //= parts
    return local
