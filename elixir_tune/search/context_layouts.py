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
