"""Token-weighted micro-batch losses: a step's loss is the mean over all its counted tokens.

A causal LM's loss is the mean over a micro-batch's counted tokens: the labels after the first
position that are not -100 (padding, a prompt under completion-only training, the turns other than
the assistant's). When the masks leave micro-batches (or data ranks) with different counts, the mean
of the micro-batch means is not the loss over the batch's tokens: a micro-batch with 3 counted tokens
would weigh as much as one with 300. The step's loss here is what one process computes on the whole
global batch (transformers' Trainer passes ``num_items_in_batch`` for the same reason): micro-batch k
of data rank r, with n_rk counted tokens of N over all micro-batches of all data ranks, weighs
``n_rk * D / N``. The engine averages gradients over the D data ranks, so the gradient is the sum of
every counted token's gradient over N, and the mean over the data ranks of what each rank returns is
the step's token-weighted loss.

N is one all-reduce of an integer over the data group per step (the ranks of one tensor or pipeline
group were fed the same micro-batches, so counting over the data group counts every token once).
When every weight is 1/K (no masks, or masks that leave every micro-batch the same count) the
engine takes its unweighted path, bitwise the same as before token weighting.

By default only causal LMs (a class named ``...ForCausalLM`` or ``...LMHeadModel``, PEFT's wrapper of
one included) are weighted: their loss is a mean over shifted labels whose count the engine knows.
Other models keep the mean of the micro-batch losses (a masked LM's or an encoder-decoder's loss
counts its labels unshifted; ``weight_by_tokens=True`` weighs them by that count).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from elixir_tune.engine.comm import Comm

IGNORE_INDEX = -100  # the label that transformers' losses (and elixir_tune.data) leave out


def is_causal_lm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers causal LM (or PEFT's wrapper of one), by its class name."""
    name = type(module).__name__
    return name.endswith(("ForCausalLM", "LMHeadModel"))


def counted_tokens(batch: dict, shift: bool = True) -> torch.Tensor | None:
    """The tokens a loss averages over: a causal LM's ``(labels[..., 1:] != -100).sum()`` (the model
    predicts position t + 1 from position t), or with ``shift=False`` every label that is not -100 (a
    masked LM, an encoder-decoder's targets); None without ``labels`` of shape (batch, length)."""
    labels = batch.get("labels")
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
        return None
    return ((labels[..., 1:] if shift else labels) != IGNORE_INDEX).sum()


def wants_token_weights(
    micro_batches: Sequence[dict], weight_by_tokens: bool | None, has_loss_fn: bool, causal_lm: bool = True
) -> bool:
    """Whether a step weighs its micro-batches by their counted tokens.

    Args:
        micro_batches: the step's micro-batches on this rank.
        weight_by_tokens: the caller's choice; None: yes when the model is a causal LM, the loss is
            its own (no ``loss_fn``) and every micro-batch has token labels, no otherwise.
        has_loss_fn: the caller passed a ``loss_fn`` (whose normalization the engine cannot know).
        causal_lm: the model is a causal LM (``is_causal_lm``).

    Returns:
        True to weigh by tokens.

    Raises:
        ValueError: ``weight_by_tokens=True`` but a micro-batch has no ``labels`` of shape (batch, length).
    """
    if weight_by_tokens is False:
        return False
    labelled = [counted_tokens(batch) is not None for batch in micro_batches]
    if weight_by_tokens is None:
        return causal_lm and not has_loss_fn and all(labelled)
    if not all(labelled):
        missing = [index for index, ok in enumerate(labelled) if not ok]
        raise ValueError(
            f"forward_backward(..., weight_by_tokens=True): micro-batches {missing[:5]} have no labels of shape "
            "(batch, length) to count tokens from; pass labels (-100 where no loss), or weight_by_tokens=False "
            "for the mean of the micro-batch losses"
        )
    return True


def token_weights(micro_batches: Sequence[dict], comm: Comm, shift: bool = True) -> list[float] | None:
    """Each micro-batch's weight ``n_k * D / N`` (a collective over the data group ``comm``).

    Args:
        micro_batches: this rank's micro-batches, each with ``labels`` of shape (batch, length).
        comm: the data-parallel group (D ranks): N counts the tokens of all its ranks.
        shift: count a causal LM's shifted labels (``counted_tokens``).

    Returns:
        The weights, or None when every one is 1/K (the plain mean of the K micro-batch losses, which
        the caller computes as before) or when no rank has a counted token (every micro-batch's mean
        loss is NaN then, and the run's non-finite check reports it).
    """
    counts = [counted_tokens(batch, shift) for batch in micro_batches]
    local = torch.stack([count.to(comm.device, torch.int64) for count in counts if count is not None])
    total = local.sum().reshape(1)
    comm.all_reduce_sum(total)
    per_micro_batch = [int(n) for n in local.tolist()]
    tokens = int(total.item())
    data_size, count = comm.world_size, len(micro_batches)
    if tokens == 0 or all(n * data_size * count == tokens for n in per_micro_batch):
        return None
    # Integer true division is correctly rounded: no error beyond the one rounding of the result.
    return [n * data_size / tokens for n in per_micro_batch]
