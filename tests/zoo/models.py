"""The zoo: tiny models of many families, each with its builder and its batches.

``ZOO`` maps a name to a ``ZooModel``: how to build the model (transformers classes from tiny
configs, nothing downloaded, or our own modules in ``handmade.py``), what its batches hold, and how a
training script reads the loss from its output. Every model is built with ``torch.manual_seed(0)``
and has no dropout, so the engine and the plain-PyTorch reference start from the same weights and
compute the same function.

Batches are deterministic (``global_batches``): the same in every process, so each rank takes its
slice of the same global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from elixir_tune.profiler.source import ModelSource
from tests.zoo import handmade

VOCAB = 128
SEQ = 8
MASK_TOKEN = 4
MASKED_PER_ROW = 3  # the same count in every row, so a micro-batch's mean loss is the global mean's share

# Shared shape of the decoder LMs: hidden 32, 2 layers, 4 heads (2 key/value heads where grouped).
DECODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo.

    Attributes:
        name: registry key.
        family: what kind of model it is (the report's first column).
        build: builds the model (call under ``torch.manual_seed``).
        inputs: "causal" (input_ids, labels = input_ids), "seq2seq" (input_ids, other labels),
            "masked" (input_ids with masked positions, labels only there) or "image".
        loss_of: the plain loop's loss from the model's output.
        loss_fn: what ``forward_backward(..., loss_fn=)`` gets (None: the output's ``.loss``).
    """

    name: str
    family: str
    build: Callable[[], nn.Module]
    inputs: str = "causal"
    loss_of: Callable[[Any], torch.Tensor] = field(default=lambda output: output.loss)
    loss_fn: Callable[[Any, dict], torch.Tensor] | None = None


def _causal_lm(config_class: str, model_class: str, **fields) -> Callable[[], nn.Module]:
    """A builder of a transformers causal LM from a config (no dropout, no KV cache)."""

    def build() -> nn.Module:
        import transformers

        config = getattr(transformers, config_class)(**{**fields, "use_cache": False})
        return getattr(transformers, model_class)(config)

    return build


def _tuple_loss(output, batch: dict) -> torch.Tensor:
    """``(logits, loss)``: the loss is the second entry."""
    return output[1]


def _t5() -> nn.Module:
    from tests.unit.models import families  # imports transformers: only when a model is built

    return families.build_t5()


def _bart() -> nn.Module:
    from tests.unit.models import families

    return families.build_bart()


def _vit() -> nn.Module:
    from tests.unit.models import vit_tiny

    return vit_tiny.build_model()


def _roberta() -> nn.Module:
    from transformers import RobertaConfig, RobertaForMaskedLM

    config = RobertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=SEQ + 4, type_vocab_size=1, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=1,
    )  # fmt: skip
    return RobertaForMaskedLM(config)


def _mamba() -> nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, use_cache=False
    )
    return MambaForCausalLM(config)


NO_DROPOUT = dict(attention_dropout=0.0)

_MODELS = [
    ZooModel("gpt2", "decoder LM (GPT-2)", _causal_lm(
        "GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    ZooModel("llama", "decoder LM (Llama)", _causal_lm(
        "LlamaConfig", "LlamaForCausalLM", **DECODER, intermediate_size=64, num_key_value_heads=2)),
    ZooModel("qwen2", "decoder LM (Qwen2)", _causal_lm(
        "Qwen2Config", "Qwen2ForCausalLM", **DECODER, intermediate_size=64, num_key_value_heads=2)),
    ZooModel("opt", "decoder LM (OPT)", _causal_lm(
        "OPTConfig", "OPTForCausalLM", **DECODER, ffn_dim=64, word_embed_proj_dim=32, dropout=0.0,
        attention_dropout=0.0, layerdrop=0.0, pad_token_id=1)),
    ZooModel("gpt_neox", "decoder LM (GPT-NeoX)", _causal_lm(
        "GPTNeoXConfig", "GPTNeoXForCausalLM", **DECODER, intermediate_size=64, hidden_dropout=0.0,
        attention_dropout=0.0)),
    ZooModel("phi3", "decoder LM (Phi-3)", _causal_lm(
        "Phi3Config", "Phi3ForCausalLM", **DECODER, intermediate_size=64, num_key_value_heads=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    ZooModel("gemma2", "decoder LM (Gemma2)", _causal_lm(
        "Gemma2Config", "Gemma2ForCausalLM", **DECODER, intermediate_size=64, num_key_value_heads=2, head_dim=8,
        query_pre_attn_scalar=8, sliding_window=4, **NO_DROPOUT)),
    ZooModel("qwen3", "decoder LM (Qwen3)", _causal_lm(
        "Qwen3Config", "Qwen3ForCausalLM", **DECODER, intermediate_size=64, num_key_value_heads=2, head_dim=8,
        **NO_DROPOUT)),
    ZooModel("olmo2", "decoder LM (OLMo2)", _causal_lm(
        "Olmo2Config", "Olmo2ForCausalLM", **DECODER, intermediate_size=64, num_key_value_heads=2, pad_token_id=1,
        **NO_DROPOUT)),
    ZooModel("falcon", "decoder LM (Falcon)", _causal_lm(
        "FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0)),
    ZooModel("bloom", "decoder LM (BLOOM)", _causal_lm(
        "BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
        hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=3)),
    ZooModel("gptj", "decoder LM (GPT-J)", _causal_lm(
        "GPTJConfig", "GPTJForCausalLM", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    ZooModel("stablelm", "decoder LM (StableLM)", _causal_lm(
        "StableLmConfig", "StableLmForCausalLM", **DECODER, intermediate_size=64, num_key_value_heads=2,
        hidden_dropout=0.0, **NO_DROPOUT)),
    ZooModel("granite", "decoder LM (Granite)", _causal_lm(
        "GraniteConfig", "GraniteForCausalLM", **DECODER, intermediate_size=64, num_key_value_heads=2,
        **NO_DROPOUT)),
    ZooModel("qwen3_moe", "mixture of experts (Qwen3-MoE, fused)", _causal_lm(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", **DECODER, intermediate_size=64, moe_intermediate_size=32,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, **NO_DROPOUT)),
    ZooModel("mixtral", "mixture of experts (Mixtral, fused)", _causal_lm(
        "MixtralConfig", "MixtralForCausalLM", **DECODER, intermediate_size=64, num_key_value_heads=2, head_dim=8,
        num_local_experts=4, num_experts_per_tok=2, **NO_DROPOUT)),
    ZooModel("t5", "encoder-decoder (T5)", _t5, inputs="seq2seq"),
    ZooModel("bart", "encoder-decoder (BART)", _bart, inputs="seq2seq"),
    ZooModel("roberta", "encoder masked LM (RoBERTa)", _roberta, inputs="masked"),
    ZooModel("mamba", "state space (Mamba)", _mamba),
    ZooModel("vit", "vision classifier (ViT)", _vit, inputs="image"),
    ZooModel("tied_lm", "hand-written, tied head (.loss)", lambda: handmade.TiedLM(VOCAB)),
    ZooModel("nanogpt", "hand-written, (logits, loss) wrapper", lambda: handmade.GPTWrapper(VOCAB),
             loss_of=lambda output: output[1], loss_fn=_tuple_loss),
]  # fmt: skip

ZOO: dict[str, ZooModel] = {model.name: model for model in _MODELS}


def build(name: str) -> nn.Module:
    """The zoo model ``name`` with its seed-0 weights, in training mode, transformers' warnings quiet."""
    from elixir_tune.profiler.source import quiet_transformers

    with quiet_transformers():
        torch.manual_seed(0)
        return ZOO[name].build().train()


def make_batch(name: str, size: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """One batch of ``size`` samples for the zoo model ``name``."""
    inputs = ZOO[name].inputs
    if inputs == "image":
        from tests.unit.models import vit_tiny

        return {
            "pixel_values": torch.randn(size, 3, vit_tiny.IMAGE, vit_tiny.IMAGE, generator=generator),
            "labels": torch.randint(0, vit_tiny.CLASSES, (size,), generator=generator),
        }
    # Token ids from 5 up: clear of every family's pad/bos/eos/mask ids used above.
    ids = torch.randint(5, VOCAB, (size, SEQ), generator=generator)
    if inputs == "seq2seq":
        return {"input_ids": ids, "labels": torch.randint(5, VOCAB, (size, SEQ), generator=generator)}
    if inputs == "masked":
        masked = torch.rand(size, SEQ, generator=generator).argsort(dim=1)[:, :MASKED_PER_ROW]
        labels = torch.full_like(ids, -100).scatter(1, masked, ids.gather(1, masked))
        return {"input_ids": ids.scatter(1, masked, MASK_TOKEN), "labels": labels}
    return {"input_ids": ids, "labels": ids.clone()}


def global_batches(name: str, steps: int, size: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``steps`` deterministic global batches of ``size`` samples (the same in every process)."""
    generator = torch.Generator().manual_seed(seed)
    return [make_batch(name, size, generator) for _ in range(steps)]


def model_source(name: str) -> ModelSource:
    """What the profiler takes for the zoo model ``name`` (the model itself: a ``(logits, loss)``
    tuple is read by ``elixir_tune.models.model_output.find_loss``)."""
    builder = ZOO[name].build

    def build_for_profile() -> nn.Module:
        torch.manual_seed(0)
        return builder()

    return ModelSource(
        name=name,
        source=f"zoo:{name}",
        default_seq_len=SEQ,
        _build=build_for_profile,
        _batch=lambda batch_size, seq_len: make_batch(name, batch_size),
    )
