"""The plain-PyTorch side that the pipeline, tensor and mesh workers share: the tests' optimizer, the
stage families' tiny models and batches, the reference training loops, and the comparison rank 0 reports.

Stage families (``tests/unit/models/stage_families.py``) are built with ``BLOCKS`` blocks, so that on 2
stages the modular split is uneven (stage 0 runs blocks 0 and 2, stage 1 block 1). Batches are
``[step][data_rank][micro]``: ``ACCUM`` micro-batches of ``MICRO`` samples of ``SEQ`` tokens per data rank,
the same in every process (seeded).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.distributed.engine_plans import param_groups
from tests.distributed.engine_worker import compare, plain_training

SEQ = 8
MICRO = 2
ACCUM = 4
BLOCKS = 3


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """The optimizer the engine tests train with (no weight decay on biases and norms: ``param_groups``)."""
    return torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)


def build_stage_family(family: str) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """The family's tiny model of ``BLOCKS`` blocks and its AdamW, seeded: every rank and the reference
    build the same weights."""
    from tests.unit.models import stage_families

    torch.manual_seed(0)
    model = stage_families.build(family, BLOCKS)
    return model, adamw(model)


def token_micro(generator: torch.Generator, length: int, padded: bool = False) -> dict:
    """One micro-batch of ``MICRO`` rows of ``length`` random token ids (from 5 up, labels the ids).

    Args:
        generator: the seeded generator the ids are drawn from (one per run: the same in every process).
        length: tokens per row.
        padded: the second row is padded over its last 2 tokens (attention mask 0, labels -100).
    """
    from tests.unit.models.stage_families import VOCAB

    ids = torch.randint(5, VOCAB, (MICRO, length), generator=generator)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        batch["attention_mask"] = torch.ones_like(ids)
        batch["attention_mask"][1, -2:] = 0
        batch["labels"][1, -2:] = -100
    return batch


def step_batches(
    steps: int, data: int, accum: int, seed: int, micro: Callable[[torch.Generator, int], dict]
) -> list[list[list[dict]]]:
    """Each step's micro-batches of each data rank, ``[step][data_rank][micro]``: ``micro(generator, k)``
    for the k-th of a rank's ``accum`` micro-batches, all drawn in that order from one generator seeded
    with ``seed`` (the same in every process)."""
    generator = torch.Generator().manual_seed(seed)
    return [[[micro(generator, k) for k in range(accum)] for _ in range(data)] for _ in range(steps)]


def stage_family_batches(steps: int, data: int = 1, lengths: tuple[int, ...] | None = None) -> list[list[list[dict]]]:
    """Each step's micro-batches of each data rank, ``[step][data_rank][micro]`` (``ACCUM`` per rank and step).

    Args:
        steps: training steps.
        data: data-parallel ranks.
        lengths: each micro-batch's length (one per micro-batch of a step); then the second sample of every
            micro-batch is padded over its last 2 tokens (attention mask 0, labels -100). None: ``SEQ`` tokens,
            no mask.

    Returns:
        The batches (token ids from 5 up, labels the ids).
    """
    return step_batches(
        steps,
        data,
        ACCUM,
        1,
        lambda generator, k: token_micro(generator, lengths[k] if lengths else SEQ, bool(lengths)),
    )


def plain_micro_training(model, opt, steps: list[list[dict]], reverse: bool = False) -> dict:
    """Plain PyTorch, micro-batch by micro-batch (each unpadded), the loss over the step's counted tokens:
    each micro-batch's mean loss weighted by its share of the step's label tokens, as the engine weighs
    them (the plain mean where every micro-batch counts as many); ``reverse``: every forward first, then
    the backwards from the last micro-batch to the first, the order in which the looped breadth-first
    schedule sums each parameter's gradient."""
    losses = []
    for micro in steps:
        total = 0.0
        micro_losses = []
        counts = [int((batch["labels"][..., 1:] != -100).sum()) for batch in micro]
        for batch, count in zip(micro, counts, strict=True):
            loss = model(**batch).loss
            loss = loss / len(micro) if len(set(counts)) == 1 else loss * (count / sum(counts))
            if not reverse:
                loss.backward()
            micro_losses.append(loss)
            total += float(loss.detach())
        for loss in reversed(micro_losses) if reverse else ():
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": [], "state": {k: v.tolist() for k, v in model.state_dict().items()}}


def stage_family_reference(family: str, steps: list[list[list[dict]]], mode: str = "whole", clip: float = 0.0) -> dict:
    """Plain PyTorch on the family's fresh model over ``steps`` (``stage_family_batches``).

    Args:
        family: the stage family.
        steps: the batches, ``[step][data_rank][micro]``.
        mode: ``whole``: one forward of each step's global batch (every data rank's micro-batches
            together); ``micro``: data rank 0's micro-batches one by one (unpadded, as a plain
            accumulation loop runs them: the reference of padded batches); ``reversed``: that loop with
            the backwards in reverse.
        clip: the max global gradient norm (``whole`` only; 0: none).

    Returns:
        ``losses``, ``norms`` and ``state`` (lists), as ``compare`` reads them.
    """
    model, opt = build_stage_family(family)
    if mode == "whole":
        keys = ("input_ids", "labels")
        whole = [{key: torch.cat([b[key] for micro in per_rank for b in micro]) for key in keys} for per_rank in steps]
        return plain_training(model, opt, whole, clip)
    assert len(steps[0]) == 1 and not clip, "the micro-batch reference runs one data rank, no clipping"
    return plain_micro_training(model, opt, [per_rank[0] for per_rank in steps], reverse=mode == "reversed")


def compare_with_reference(state: dict[str, torch.Tensor], norms: list[float], reference: dict, world_losses) -> dict:
    """Rank 0's report: the largest loss, clipped-norm and weight differences from ``reference``, and its losses.

    Args:
        state: the engine's full state dict (``model.state_dict()`` on rank 0).
        norms: the engine's clipped gradient norms per step (empty without clipping).
        reference: the plain-PyTorch run (``losses``, ``norms``, ``state``).
        world_losses: the engine's loss of each step over the global batch.

    Returns:
        ``loss_rel``, ``weight_abs``, ``norm_rel`` and ``reference_losses``.
    """
    engine = {"state": {k: v.tolist() for k, v in state.items()}, "norms": norms}
    return dict(compare(engine, reference, world_losses), reference_losses=reference["losses"])


def state_round_trip(model) -> bool:
    """Whether loading the engine model's full weights (sliced again per rank: tensor pieces, expert
    rows) and reading them back changes nothing; a collective: every rank calls it."""
    everywhere = model.state_dict(all_ranks=True)
    model.load_state_dict({k: v * 2 for k, v in everywhere.items()})
    model.load_state_dict(everywhere)
    reloaded = model.state_dict(all_ranks=True)
    return all(torch.equal(reloaded[k], v) for k, v in everywhere.items())
