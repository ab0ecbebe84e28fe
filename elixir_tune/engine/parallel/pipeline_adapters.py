"""The stage adapter: how a transformers causal LM runs piece by piece on pipeline stages.

One adapter for every family, driven by the model's stage plan (``elixir_tune/models/stage_plans.py``:
transformers' ``config.base_model_pp_plan``, or our table in the same format for GPT-2 and OPT). A
virtual stage runs some consecutive blocks; the first also the modules before the blocks
(embeddings), the last also those after them (final norm), the ``lm_head`` and the loss
(``plan/stages.py``: parameters used before block 0 go with its stage, those after the last block
with its stage).

A stage runs **the model's own forward**, the causal LM's, with the block list swapped for the call
by one of stand-ins: blocks before the stage's first one return the stage's input (the hidden states
received from the stage before), the stage's own blocks run, and the one after its last block stops
the forward there and hands its input back as the stage's output. So everything every block takes
besides the hidden states (the causal or sliding-window mask built from the padding mask, the
position ids, the rotary embeddings of ``rotary_emb``) is built on each stage exactly as the
family's forward builds it, and the last stage gets the family's logits (GPT-2's, Gemma2's
soft-capped ones, Granite's scaled ones) from the same forward. Later stages pass the received
hidden states as ``inputs_embeds`` (the embedding lookup is skipped), and the modules before the
blocks that own parameters (GPT-2's position embeddings, OPT's) are stood in for by a zero: what
they compute there is discarded by the first stand-in block, and they run only on the first stage.
The engine's hooks sit on the model's own modules, so chunks are gathered and gradients reduced
exactly as in an unsplit forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any, cast

import torch
from torch import nn

from elixir_tune.engine.parallel.pipeline_tensor import StageBoundary
from elixir_tune.models.stage_plans import StagePlan, resolve_stage_plan


class _StageDone(Exception):
    """Raised by the stand-in after a stage's last block: the forward ends there."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("pipeline stage done")
        self.hidden = hidden


class _Entry(nn.Module):
    """Stands in for a block before the stage's first: gives the stage's input, ignoring its own."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.hidden


class _Exit(nn.Module):
    """Stands in for the block after the stage's last: ends the forward with the hidden states it gets."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        raise _StageDone(hidden_states)


class _Zero(nn.Module):
    """Stands in, on a later stage, for a module before the blocks that owns parameters: its output only
    feeds what the first ``_Entry`` discards."""

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return torch.zeros(())


class StageAdapter:
    """The pieces of a causal LM, as its stage plan names them.

    Attributes:
        model: the user's module.
        stage_plan: where the stages cut it (``stage_plans.StagePlan``).
        block_list: the blocks' dotted path (the plan's ``model.block_list``).
        blocks: the repeated blocks.
        first_modules: modules run before block 0; their parameters go with block 0's stage.
        last_modules: modules run after the last block (final norm, head).
        hidden_size: width of the hidden states passed between stages.
        vocab_size: width of the logits.
    """

    def __init__(self, model: nn.Module, stage_plan: StagePlan):
        # Any: transformers' modules are reached by attribute (nn.Module types them Tensor | Module).
        self.model: Any = cast(Any, model)
        self.stage_plan = stage_plan
        self.block_list = stage_plan.block_list
        self.body: Any = model.get_submodule(stage_plan.body)
        self.config: Any = self.model.config
        self.blocks: Any = self.body.get_submodule(stage_plan.blocks)
        self.first_modules: list[nn.Module] = [self.body.get_submodule(name) for name in stage_plan.first]
        self.last_modules: list[nn.Module] = [self.body.get_submodule(name) for name in stage_plan.last]
        self.last_modules.append(self.model.lm_head)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(getattr(self.model.lm_head, "out_features", self.config.vocab_size))
        # What crosses a stage boundary (pipeline_tensor.py: a tensor-parallel stage's sequence shards);
        # identities without tensor parallelism.
        self.boundary = StageBoundary()
        # Context parallelism (pipeline x context): the model's hooks slice the tokens on the first stage;
        # later stages receive hidden states already sliced (``ContextParallel.received``).
        self.context: Any = None
        # Modules before the blocks that own parameters: stood in for on later stages.
        self._weighted_first = [
            name
            for name, module in zip(stage_plan.first, self.first_modules, strict=True)
            if next(module.parameters(), None) is not None
        ]

    def run(
        self,
        inputs: torch.Tensor,
        block_indices: list[int],
        first: bool,
        last: bool,
        model_inputs: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """One virtual stage's forward through the model's own forward.

        Args:
            inputs: ``input_ids`` on the first stage, the received hidden states on the others.
            block_indices: the stage's blocks (consecutive).
            first: the stage runs block 0 (and the modules before it).
            last: the stage runs the last block (and the modules after it, and the head).
            model_inputs: the micro-batch's other inputs to the model's forward: ``attention_mask`` (its padding
                mask) and ``position_ids`` (packed rows), where it has them.

        Returns:
            The hidden states after the stage's last block, or the logits on the last stage.
        """
        count = len(self.blocks)
        start, end = block_indices[0], block_indices[-1]
        entered = self.boundary.enter(inputs) if start else inputs
        stand_ins: list[nn.Module] = [_Entry(entered) for _ in range(start)]
        stand_ins += [self.blocks[i] for i in block_indices]
        stand_ins += [_Exit() for _ in range(end + 1, count)]
        swapped: dict[str, nn.Module] = {self.stage_plan.blocks: nn.ModuleList(stand_ins)}
        if not first:
            swapped.update({name: _Zero() for name in self._weighted_first})
        originals = {name: self.body._modules[name] for name in swapped}
        self.body._modules.update(swapped)
        try:
            feed = {"input_ids": inputs} if first else {"inputs_embeds": self.boundary.widen(inputs)}
            received = self.context.received() if self.context is not None and not first else nullcontext()
            with received:
                output = self.model(**feed, **model_inputs, use_cache=False)
        except _StageDone as done:
            if last:
                raise
            return self.boundary.leave(done.hidden)
        finally:
            self.body._modules.update(originals)
        if not last:
            raise RuntimeError(f"the stage of blocks {block_indices} ran past its last block")
        return output.logits

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The model's own causal-LM loss (labels shifted inside, as the model's forward does)."""
        return self.model.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size)


def adapter_for(model: nn.Module, block_list: str) -> StageAdapter:
    """The stage adapter of ``model``, from its stage plan.

    Args:
        model: a transformers causal LM.
        block_list: the plan's ``model.block_list`` (must be the stage plan's block list).

    Raises:
        ValueError: a model without a stage plan the engine can run (the reason, as the profile
            records it), or a plan whose block list is another one.
    """
    stage_plan = resolve_stage_plan(model)
    if isinstance(stage_plan, str):
        raise ValueError(f"pipeline parallelism cannot run this model: {stage_plan}; use parallel.pipeline.stages 1")
    adapter = StageAdapter(model, stage_plan)
    if block_list != adapter.block_list:
        model_type = getattr(adapter.config, "model_type", "")
        raise ValueError(
            f"the plan's model.block_list is {block_list!r} but a {model_type} model's pipeline stages split "
            f"{adapter.block_list!r}; profile and search the plan again"
        )
    return adapter
