"""The architecture numbers of a transformers model, read from its HF config.

Families name the same number differently (GPT-2's ``n_inner``, OPT's ``ffn_dim``, Llama's
``intermediate_size``); transformers' ``attribute_map`` already answers ``hidden_size``,
``num_attention_heads`` and ``num_hidden_layers`` for all of them, so only the MLP width and the
key/value heads need a fallback chain here.
"""

from __future__ import annotations

from typing import Any

from elixir_tune.models.hf_plans import config_plan
from elixir_tune.profiler.schema import ModelArch

# Where each family keeps its MLP width, first match wins; GPT-2's n_inner is None for 4 x hidden.
_INTERMEDIATE_NAMES = ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "encoder_ffn_dim")
# Routed experts per block (Qwen3-MoE, Mixtral, DeepSeek-V3 name it differently), and experts per token.
_EXPERT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts")
_TOP_K_NAMES = ("num_experts_per_tok", "num_experts_per_token")


def _positive_int(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def model_arch(model: Any) -> ModelArch:
    """The architecture numbers of ``model.config`` (all zero when the model has no HF config).

    Args:
        model: a module; transformers models carry a ``config``.

    Returns:
        The numbers; a missing one is 0, and the MLP width defaults to 4 x hidden as in GPT-2.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if config is None or not isinstance(model_type, str):
        return ModelArch()
    hidden = _positive_int(config, "hidden_size")
    heads = _positive_int(config, "num_attention_heads")
    intermediate = next((_positive_int(config, name) for name in _INTERMEDIATE_NAMES if _positive_int(config, name)), 0)
    # Expert parallelism runs a family whose config dispatches tokens to its experts (engine/parallel/expert_parallel.py).
    ep_plan = config_plan(config, "base_model_ep_plan")
    dispatches = "ep_dispatch_experts" in ep_plan.values()
    experts = next((_positive_int(config, name) for name in _EXPERT_NAMES if _positive_int(config, name)), 0)
    top_k = next((_positive_int(config, name) for name in _TOP_K_NAMES if _positive_int(config, name)), 0)
    return ModelArch(
        model_type=model_type,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=_positive_int(config, "num_key_value_heads") or heads,
        intermediate_size=intermediate or 4 * hidden,
        vocab_size=_positive_int(config, "vocab_size"),
        num_layers=_positive_int(config, "num_hidden_layers"),
        num_experts=experts if dispatches else 0,
        experts_per_token=top_k if dispatches else 0,
        attention_scores=getattr(config, "_attn_implementation", None) == "eager",
    )


def token_vocab(model: Any) -> int:
    """The token ids the model's input takes: its config's ``vocab_size``, else the rows of its first
    ``nn.Embedding`` (a model of one's own); 0 when it has neither.

    Args:
        model: the model (on any device, meta included).

    Returns:
        The vocabulary size, or 0.
    """
    from torch import nn

    vocab = _positive_int(getattr(model, "config", None), "vocab_size")
    if vocab:
        return vocab
    embedding = next((module for module in model.modules() if isinstance(module, nn.Embedding)), None)
    return int(embedding.num_embeddings) if embedding is not None else 0
