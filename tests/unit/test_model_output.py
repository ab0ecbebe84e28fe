"""Where the profiler and forward_backward find a model's loss (elixir_tune/models/model_output.py)."""

from __future__ import annotations

import torch

from elixir_tune.models.model_output import find_loss


def test_the_shapes_a_loss_comes_in():
    loss = torch.tensor(2.0, requires_grad=True)
    logits = torch.zeros(2, 3, requires_grad=True)
    assert find_loss(loss) is loss
    assert find_loss({"loss": loss, "logits": logits}) is loss
    assert find_loss(type("Output", (), {"loss": loss})()) is loss
    assert find_loss((logits, loss)) is loss  # nanoGPT's (logits, loss)
    assert find_loss([loss, logits]) is loss


def test_an_ambiguous_or_missing_loss_is_not_guessed():
    first, second = torch.tensor(1.0, requires_grad=True), torch.tensor(2.0, requires_grad=True)
    logits = torch.zeros(2, 3, requires_grad=True)
    assert find_loss((first, second)) is None  # two scalars: which one is the loss?
    assert find_loss((logits, None)) is None  # nanoGPT without targets
    assert find_loss((logits, torch.tensor(1.0))) is None  # a constant, not a loss
    assert find_loss({"logits": logits}) is None
