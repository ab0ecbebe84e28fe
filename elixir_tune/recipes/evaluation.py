"""Evaluation loss over a held-out split: the token-weighted mean of the model's loss, and its perplexity.

Each data-parallel rank evaluates every ``data_size``-th batch of the split (forward only: ``model.eval()`` and
``torch.no_grad()``); the sums of loss x tokens and of tokens are then added over all ranks. Every rank runs the
same number of forwards, because a forward gathers chunks collectively: a rank with no batch left repeats one with
weight 0, and so does a batch with no loss tokens (all its labels -100, e.g. a prompt cut at seq_len). The ranks of one tensor or pipeline group evaluate the same batches, so their sums count alike in the
numerator and the denominator and the mean is unchanged.

A pipeline plan has no forward outside its schedule: there the batches go through ``model.forward_backward`` under
``torch.no_grad()``, which runs the schedule's forwards only (torch's ``eval`` step), ``grad_accum_steps`` batches
per call (a count the plan's schedule runs). Its ``loss_fn`` returns each batch's loss times its loss tokens (0 for
a stand-in), so the call's mean times the count is the batches' sum of loss x tokens: the same sums as above. The
batches of one call need one batch size: a smaller one (the split's last) gets rows of pad tokens without labels,
which change no other row's logits and count no token.
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
    pipeline = getattr(getattr(model, "engine", None), "pipeline", None)
    model.eval()
    try:
        with torch.no_grad():
            if pipeline is not None:
                per_call = pipeline.full_plan.training.grad_accum_steps
                sums += pipeline_sums(model, mine, rounds, batches[0], per_call)
            for index in range(rounds if pipeline is None else 0):
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


def pipeline_sums(
    model, mine: list[dict[str, torch.Tensor]], rounds: int, stand_in: dict[str, torch.Tensor], per_call: int
) -> torch.Tensor:
    """Sums of loss x tokens and of tokens over ``mine`` through a pipeline plan's forward-only schedule.

    Args:
        model: the ElixirModel of a pipeline plan, in eval mode, under ``torch.no_grad()``.
        mine: this data rank's batches.
        rounds: the batches every data rank runs (the same number on all: the forwards gather chunks
            collectively); past ``mine``, ``stand_in`` runs with weight 0.
        stand_in: a batch of the split, for the rounds this rank has no batch for.
        per_call: batches per ``forward_backward`` call (the plan's ``grad_accum_steps``).

    Returns:
        ``[sum of loss x tokens, tokens]`` (float64).
    """
    sums = torch.zeros(2, dtype=torch.float64)
    weights: dict[int, int] = {}  # id of a call's batch -> its loss tokens (0: a stand-in)

    def weighted_loss(output, batch) -> torch.Tensor:
        tokens = weights[id(batch)]
        # A batch without loss tokens has a NaN mean loss: it adds 0, not NaN x 0.
        return output.loss * tokens if tokens else output.logits.new_zeros(())

    for start in range(0, rounds, per_call):
        indices = range(start, start + per_call)
        call = [_model_inputs(mine[i] if i < len(mine) else stand_in) for i in indices]
        rows = max(batch["input_ids"].shape[0] for batch in call)
        call = [_pad_rows(batch, rows) for batch in call]
        weights = {
            id(batch): predicted_tokens(batch) if i < len(mine) else 0 for i, batch in zip(indices, call, strict=True)
        }
        mean = model.forward_backward(call, loss_fn=weighted_loss, weight_by_tokens=False)
        sums += torch.tensor([float(mean) * per_call, sum(weights.values())], dtype=torch.float64)
    return sums


def _model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fresh dict (its id names it in one call) of the keys a pipeline plan feeds the model."""
    return {key: batch[key] for key in ("input_ids", "attention_mask", "labels") if key in batch}


def _pad_rows(batch: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """``batch`` with rows of token 0 added up to ``rows``: labels -100 (no loss token), attention 1 (a
    fully masked row could turn its logits NaN); a causal LM's rows do not see each other."""
    missing = rows - batch["input_ids"].shape[0]
    if missing <= 0:
        return batch
    fill = {"input_ids": 0, "attention_mask": 1, "labels": -100}
    return {
        key: torch.cat([value, value.new_full((missing, *value.shape[1:]), fill[key])]) for key, value in batch.items()
    }
