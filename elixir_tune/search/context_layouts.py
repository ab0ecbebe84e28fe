"""Context-parallel layouts for the search (``--fix context=C``).

This version offers context parallelism only when pinned: the engine runs it on data x context
worlds (Ulysses, ``plan/context.py``), so a pin yields the one layout with C and no pipeline,
tensor or expert degree, checked against the same rules ``validate`` applies. The search does not
yet try C on its own (its ranking would then weigh the all-to-alls against data parallelism, and
the cost model's figures for them are not yet checked against a measured run).
"""

from __future__ import annotations

from elixir_tune.costmodel.parallel import Layout
from elixir_tune.plan.context import context_problems
from elixir_tune.profiler.schema import ModelProfile


def context_layouts(profile: ModelProfile, world: int, global_batch_size: int, fixed: dict) -> list[Layout]:
    """The layout of a ``--fix context=C`` pin, checked.

    Args:
        profile: the whole model's profile.
        world: every rank.
        global_batch_size: samples per step.
        fixed: pinned choices (``parse_fixed``), with ``context`` > 1.

    Returns:
        ``[Layout(context=C)]``.

    Raises:
        ValueError: the pin cannot run (says why: the engine's limits, the model's heads or sequence,
            the world or the global batch).
    """
    degree = fixed["context"]
    arch = profile.arch
    parallel = {
        "context": {"degree": degree},
        "pipeline": {"stages": fixed.get("pipeline", 1)},
        "tensor": {"degree": fixed.get("tensor", 1)},
        "expert": {"degree": fixed.get("expert", 1)},
    }
    model = {"model_type": arch.model_type, "num_heads": arch.num_heads, "num_kv_heads": arch.num_kv_heads}
    training = {"seq_len": profile.seq_len, "accumulation": fixed.get("accumulation", "standard")}
    problems = context_problems(parallel, model, training)
    if world % degree:
        problems.append(f"it does not divide the world of {world} GPUs")
    elif global_batch_size % (world // degree):
        problems.append(
            f"the global batch {global_batch_size} does not split over the {world // degree} data-parallel ranks "
            f"it leaves ({world} GPUs / context {degree})"
        )
    if problems:
        raise ValueError(f"--fix context={degree}: not possible for {profile.name}: {'; '.join(problems)}")
    return [Layout(context=degree)]


def with_context_pins(fixed: dict) -> dict:
    """``fixed`` with the pins a context layout needs: standard accumulation (the engine's context
    parallelism does not run layered threads; a pinned ``layered`` is refused by ``context_layouts``)."""
    if fixed.get("context", 1) <= 1 or "accumulation" in fixed:
        return fixed
    return {**fixed, "accumulation": "standard"}


# Pins that say the user asked for a layout or a per-rank micro-batch: no context degree is offered then.
_LAYOUT_PINS = ("context", "pipeline", "tensor", "tensor_mode", "expert", "micro_batch_size")


def fallback_context_layouts(
    profile: ModelProfile, gpus_per_node: int, nodes: int, global_batch_size: int, fixed: dict
) -> list[Layout]:
    """Context layouts to try when no layout without context parallelism fits (the search then
    offers C on its own): every C >= 2 within one node that divides the world and leaves a
    data-parallel degree dividing the global batch, for which ``plan/context.py`` finds no problem;
    none when ``fixed`` pins a layout, a per-rank micro-batch or layered accumulation.

    Why only then: where another layout fits, the search's ranking of the all-to-alls against it is
    not yet checked against a measured run; where nothing else fits, context parallelism is the one
    way to a plan (activations, and the logits, shrink by C). A pinned layout or micro-batch (e.g. a
    published data-parallel run reproduced) keeps its answer, a refusal included.
    """
    if any(key in fixed for key in _LAYOUT_PINS) or fixed.get("accumulation") == "layered":
        return []
    world = gpus_per_node * nodes
    arch = profile.arch
    model = {"model_type": arch.model_type, "num_heads": arch.num_heads, "num_kv_heads": arch.num_kv_heads}
    training = {"seq_len": profile.seq_len, "accumulation": "standard"}
    return [
        Layout(context=degree)
        for degree in range(2, gpus_per_node + 1)
        if world % degree == 0
        and global_batch_size % (world // degree) == 0
        and not context_problems({"context": {"degree": degree}}, model, training)
    ]
