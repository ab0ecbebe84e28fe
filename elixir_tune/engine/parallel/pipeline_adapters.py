"""Per-family stage adapters: how a transformers causal LM runs piece by piece on pipeline stages.

A pipeline stage runs some of the model's blocks; the first one also the embeddings, the last one
also the final norm, the head and the loss (``plan/stages.py``: parameters used before the first
block belong to block 0's stage, those after the last block to block N-1's). The model's own
``forward`` runs all of them in one call, so a stage instead calls the model's own submodules in
the order that forward does: ``embed`` (first stage), ``block`` for each of its blocks (after
``context``, the per-micro-batch inputs every block takes besides the hidden states: causal mask,
positions, rotary embeddings, which own no parameters and are recomputed on every stage), ``head``
(last stage) and ``loss``. The engine's hooks sit on those same submodules, so chunks are gathered
and gradients reduced exactly as in an unsplit forward.

An adapter exists per family (``adapter_for``): GPT-2, the Llama family (Llama, Mistral, Qwen2:
the same module layout) and OPT. Each is a few lines that mirror the family's ``forward`` in
transformers 4.5x/5.x; a model of another family gets a clear error naming the supported ones.
Only ``input_ids`` enter the first stage (no padding mask: positions are 0..seq-1, the mask is
causal), as in the training scripts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn


class StageAdapter:
    """The pieces of one family's causal LM.

    Attributes:
        model: the user's module.
        blocks: its repeated blocks (the plan's ``model.block_list``).
        first_modules: modules run before block 0 (embeddings); their parameters go with block 0's stage.
        last_modules: modules run after the last block (final norm, head).
        hidden_size: width of the hidden states passed between stages.
        vocab_size: width of the logits.
    """

    block_list = ""

    def __init__(self, model: nn.Module):
        # Any: transformers' modules are reached by attribute (nn.Module types them Tensor | Module).
        self.model: Any = cast(Any, model)
        self.body: Any = None
        self.config: Any = self.model.config
        self.blocks: Any = model.get_submodule(self.block_list)
        self.first_modules: list[nn.Module] = []
        self.last_modules: list[nn.Module] = []
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.config.vocab_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden states entering block 0."""
        raise NotImplementedError

    def context(self, hidden: torch.Tensor) -> dict[str, Any]:
        """What every block takes besides the hidden states (no parameters involved)."""
        return {}

    def block(self, block: nn.Module, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits from the last block's hidden states."""
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The model's own causal-LM loss (labels shifted inside, as the model's forward does)."""
        return self.model.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size)


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _causal_mask(config, hidden: torch.Tensor, positions: torch.Tensor | None):
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(
        config=config, inputs_embeds=hidden, attention_mask=None, past_key_values=None, position_ids=positions
    )


class GPT2Adapter(StageAdapter):
    """``GPT2LMHeadModel``: wte + wpe (then dropout), blocks ``transformer.h``, ``ln_f``, ``lm_head`` (tied to wte)."""

    block_list = "transformer.h"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        body = self.model.transformer
        self.body = body
        self.first_modules = [body.wte, body.wpe, body.drop]
        self.last_modules = [body.ln_f, self.model.lm_head]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        body = self.body
        embeds = body.wte(input_ids)
        return body.drop(embeds + body.wpe(_positions(embeds)))

    def context(self, hidden: torch.Tensor) -> dict[str, Any]:
        positions = _positions(hidden)
        return {"mask": _causal_mask(self.config, hidden, positions), "positions": positions}

    def block(self, block: nn.Module, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        return block(hidden, None, context["mask"], None, use_cache=False, position_ids=context["positions"])

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.body.ln_f(hidden))


class LlamaAdapter(StageAdapter):
    """Llama, Mistral, Qwen2: ``model.embed_tokens``, ``model.layers`` (rotary embeddings computed once per
    stage from ``model.rotary_emb``), ``model.norm``, ``lm_head``."""

    block_list = "model.layers"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.body = self.model.model
        self.first_modules = [self.body.embed_tokens]
        self.last_modules = [self.body.norm, self.model.lm_head]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.body.embed_tokens(input_ids)

    def context(self, hidden: torch.Tensor) -> dict[str, Any]:
        positions = _positions(hidden)
        return {
            "mask": _causal_mask(self.config, hidden, positions),
            "positions": positions,
            "rotary": self.body.rotary_emb(hidden, position_ids=positions),
        }

    def block(self, block: nn.Module, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        return block(
            hidden,
            attention_mask=context["mask"],
            position_embeddings=context["rotary"],
            position_ids=context["positions"],
            past_key_values=None,
            use_cache=False,
        )

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.body.norm(hidden))


class OPTAdapter(StageAdapter):
    """``OPTForCausalLM``: token embeddings (+ ``project_in``) + learned positions, ``model.decoder.layers``,
    ``final_layer_norm`` (+ ``project_out``), ``lm_head`` (tied to the token embeddings by default)."""

    block_list = "model.decoder.layers"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        decoder = self.model.model.decoder
        self.body = decoder
        self.first_modules = [
            m for m in (decoder.embed_tokens, decoder.project_in, decoder.embed_positions) if m is not None
        ]
        self.last_modules = [m for m in (decoder.final_layer_norm, decoder.project_out) if m is not None] + [
            model.lm_head
        ]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        decoder = self.body
        embeds = decoder.embed_tokens(input_ids)
        ones = torch.ones(embeds.shape[:2], device=embeds.device)
        positions = decoder.embed_positions(ones, 0, position_ids=_positions(embeds))
        if decoder.project_in is not None:
            embeds = decoder.project_in(embeds)
        return embeds + positions

    def context(self, hidden: torch.Tensor) -> dict[str, Any]:
        return {"mask": _causal_mask(self.config, hidden, None), "positions": _positions(hidden)}

    def block(self, block: nn.Module, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        return block(
            hidden,
            attention_mask=context["mask"],
            position_ids=context["positions"],
            past_key_values=None,
            use_cache=False,
        )

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        decoder = self.body
        if decoder.final_layer_norm is not None:
            hidden = decoder.final_layer_norm(hidden)
        if decoder.project_out is not None:
            hidden = decoder.project_out(hidden)
        return self.model.lm_head(hidden)


ADAPTERS: dict[str, Callable[[nn.Module], StageAdapter]] = {
    "gpt2": GPT2Adapter,
    "llama": LlamaAdapter,
    "mistral": LlamaAdapter,
    "qwen2": LlamaAdapter,
    "opt": OPTAdapter,
}


def adapter_for(model: nn.Module, block_list: str) -> StageAdapter:
    """The stage adapter of ``model``'s family.

    Args:
        model: a transformers causal LM.
        block_list: the plan's ``model.block_list`` (must be the family's block list).

    Raises:
        ValueError: a family without an adapter, or a plan whose block list is another one.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    make = ADAPTERS.get(str(model_type))
    if make is None or not hasattr(model, "lm_head"):
        raise ValueError(
            f"pipeline parallelism runs transformers causal LMs of the families {', '.join(sorted(ADAPTERS))} "
            f"(a stage adapter per family, elixir_tune/engine/pipeline_adapters.py); this model is "
            f"{type(model).__name__} (model_type {model_type!r}); use parallel.pipeline.stages 1 for it"
        )
    adapter = make(model)
    if block_list != adapter.block_list:
        raise ValueError(
            f"the plan's model.block_list is {block_list!r} but a {model_type} model's pipeline stages split "
            f"{adapter.block_list!r}; profile and search the plan again"
        )
    return adapter
