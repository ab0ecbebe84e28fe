"""Evaluation loss over a held-out split: the token-weighted mean of the model's loss, and its perplexity.

Each data-parallel rank evaluates every ``data_size``-th batch of the split (forward only: ``model.eval()`` and
``torch.no_grad()``); the sums of loss x tokens and of tokens are then added over all ranks. Every rank runs the
same number of forwards, because a forward gathers chunks collectively: a rank with no batch left repeats one with
weight 0, and so does a batch with no loss tokens (all its labels -100, e.g. a prompt cut at seq_len). The ranks of one tensor or pipeline group evaluate the same batches, so their sums count alike in the
numerator and the denominator and the mean is unchanged. A pipeline plan has no forward outside its schedule:
evaluation is refused there before training starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class EvalResult:
    """One evaluation: ``loss`` (token-weighted mean), ``perplexity`` (exp of it) and ``tokens`` counted."""

    loss: float
    perplexity: float
    tokens: int


def predicted_tokens(batch: dict[str, torch.Tensor]) -> int:
    """How many tokens a causal LM's loss averages over: labels after the first position that are not -100."""
    return int((batch["labels"][:, 1:] != -100).sum())


def evaluate(model, batches: list[dict[str, torch.Tensor]], data_rank: int, data_size: int, device) -> EvalResult:
    """The split's loss on every rank (all ranks must call it together).

    Args:
        model: the ElixirModel.
        batches: the whole split's batches, in order (every rank passes the same list).
        data_rank: this rank's data-parallel index.
        data_size: the data-parallel degree.
        device: where the model runs.

    Returns:
        The token-weighted mean loss over the split, its perplexity and the token count.
    """
    mine = batches[data_rank::data_size]
    rounds = math.ceil(len(batches) / data_size)
    sums = torch.zeros(2, dtype=torch.float64)
    model.eval()
    try:
        with torch.no_grad():
            for index in range(rounds):
                batch = mine[index] if index < len(mine) else batches[0]  # a stand-in forward, weight 0
                output = model(**{key: value.to(device) for key, value in batch.items()})
                loss = output.loss if hasattr(output, "loss") else output
                tokens = predicted_tokens(batch) if index < len(mine) else 0
                if tokens:  # a batch without loss tokens has a NaN mean loss and no weight: skipped
                    sums += torch.tensor([float(loss) * tokens, tokens], dtype=torch.float64)
    finally:
        model.train()
    replicas = 1  # the ranks of one tensor or pipeline group, which evaluate the same batches
    if dist.is_initialized() and dist.get_world_size() > 1:
        summed = sums.to(device)
        dist.all_reduce(summed)
        sums = summed.cpu()
        replicas = dist.get_world_size() // data_size
    mean = float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")
    return EvalResult(loss=mean, perplexity=math.exp(min(mean, 700.0)), tokens=int(sums[1]) // replicas)
