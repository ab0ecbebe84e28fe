"""Context-parallel layouts for the search: every context degree C and mode the plan's rules accept.

Beside each layout without context parallelism (pipeline P, tensor T, expert E), the search tries
C >= 2 with each mode (``ulysses``, ``allgather``, ``ring``) where ``plan/context.py``
``context_problems`` finds nothing wrong: the same rules ``validate`` applies, so a searched plan
always validates, and a mode or a composition the engine learns to run (a table entry set to True)
is offered without a change here. C is tried where the group stays on one node (C x T divides the
GPUs of a node: its exchange is inside every attention block, on the compute stream), where it
divides the world and where the data degree world / (P x T x C) divides the global batch.
``--fix context=C`` keeps only layouts with that C (pinned beyond one node too), ``--fix
context=1`` none, ``--fix context_mode=M`` one mode. The cost model prices each
(``costmodel/context.py``); the joint search ranks them with every other layout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

from elixir_tune.costmodel.context import MODES
from elixir_tune.costmodel.model import CostModel
from elixir_tune.costmodel.parallel import Layout
from elixir_tune.plan.context import context_problems
from elixir_tune.plan.schema import ContextMode
from elixir_tune.profiler.schema import ModelProfile
from elixir_tune.search.candidate import Candidate


def _problems(profile: ModelProfile, layout: Layout, degree: int, mode: str, accumulation: str) -> list[str]:
    """``context_problems`` of a layout with context degree ``degree`` in ``mode``."""
    arch = profile.arch
    parallel = {
        "context": {"degree": degree, "mode": mode},
        "pipeline": {"stages": layout.pipeline},
        "tensor": {"degree": layout.tensor},
        "expert": {"degree": layout.expert},
    }
    model = {"model_type": arch.model_type, "num_heads": arch.num_heads, "num_kv_heads": arch.num_kv_heads}
    return context_problems(parallel, model, {"seq_len": profile.seq_len, "accumulation": accumulation})


def context_modes(fixed: dict) -> list[str]:
    """The modes to try: the pinned one, or all."""
    return [fixed["context_mode"]] if "context_mode" in fixed else list(MODES)


def context_variants(
    profile: ModelProfile, bases: list[Layout], gpus_per_node: int, nodes: int, global_batch_size: int, fixed: dict
) -> list[Layout]:
    """The context-parallel layouts to try beside ``bases`` (module docstring).

    Args:
        profile: the whole model's profile.
        bases: layouts without context parallelism (whatever their batch split).
        gpus_per_node: ranks per node.
        nodes: nodes.
        global_batch_size: samples per step.
        fixed: pinned choices (``parse_fixed``).

    Returns:
        The layouts, each with C >= 2 and a mode.
    """
    pinned = fixed.get("context")
    if pinned == 1:
        return []
    world = gpus_per_node * nodes
    accumulation = fixed.get("accumulation", "standard")
    out = []
    for base in bases:
        degrees = (
            [pinned] if pinned else [c for c in range(2, gpus_per_node + 1) if (gpus_per_node // base.tensor) % c == 0]
        )
        for degree in degrees:
            ranks = base.pipeline * base.tensor * degree
            if world % ranks or global_batch_size % (world // ranks):
                continue
            for mode in context_modes(fixed):
                if not _problems(profile, base, degree, mode, accumulation):
                    out.append(replace(base, context=degree, context_mode=cast(ContextMode, mode)))
    return out


def context_pin_problem(profile: ModelProfile, base: Layout, world: int, global_batch_size: int, fixed: dict) -> str:
    """Why ``--fix context=C`` (and ``--fix context_mode``) gives no layout beside ``base``: the plan's
    rules for each mode tried, the world or the global batch.

    Returns:
        The error message.
    """
    degree = fixed["context"]
    modes = context_modes(fixed)
    problems = _problems(profile, base, degree, modes[0], fixed.get("accumulation", "standard"))
    if len(modes) > 1:  # say why the others fail too, when they fail otherwise
        for mode in modes[1:]:
            problems += [p for p in _problems(profile, base, degree, mode, "standard") if p not in problems]
    ranks = base.pipeline * base.tensor * degree
    if world % ranks:
        problems.append(f"it does not divide the world of {world} GPUs")
    elif global_batch_size % (world // ranks):
        problems.append(
            f"the global batch {global_batch_size} does not split over the {world // ranks} data-parallel ranks "
            f"it leaves ({world} GPUs / context {degree})"
        )
    return f"--fix context={degree}: not possible for {profile.name}: {'; '.join(problems)}"


def layered_refused(profile: ModelProfile, layout: Layout) -> bool:
    """Whether the engine does not run layered accumulation beside the layout's context parallelism
    (``plan/context.py``): the joint search then tries standard accumulation only."""
    if layout.context <= 1:
        return False
    return bool(_problems(profile, layout, layout.context, layout.context_mode, "layered")) and not _problems(
        profile, layout, layout.context, layout.context_mode, "standard"
    )


def without_dominated_modes(models: dict[Layout, CostModel]) -> dict[Layout, CostModel]:
    """``models`` less each context layout that another mode of the same layout dominates: its
    exchange (and extra attention) takes at least as long for every micro-batch and checkpointing, and
    its activation lines hold at least as much, so each of its shapes is slower and larger than the
    same shape of the other (the chunks, cache and offload are the same). The engine's all-gather
    form is dominated by Ulysses wherever both run at long sequences (it computes the masked half of
    its attention and keeps the gathered keys and values); the search skips it there, which keeps its
    time near the one without context parallelism."""

    def costs(model: CostModel) -> tuple[float, ...]:
        plain, full = model.profile.activation, model.profile.activation_checkpointed
        lines = (
            plain.fixed_bytes,
            plain.per_sample_bytes,
            *((full.fixed_bytes, full.per_sample_bytes) if full else ()),
        )
        return (*model.context_s(1, 0), sum(model.context_s(1, 1)), *lines)

    kept = {}
    for layout, model in models.items():
        if layout.context > 1:
            own = costs(model)
            rivals = [
                other
                for key, other in models.items()
                if key != layout
                and key.context_mode != layout.context_mode
                and replace(key, context_mode=layout.context_mode) == layout
            ]
            if any(
                all(a >= b for a, b in zip(own, costs(rival), strict=True)) and own != costs(rival) for rival in rivals
            ):
                continue
        kept[layout] = model
    return kept


def share_chunk_caches(models: dict[Layout, CostModel]) -> None:
    """Lets the context variants of one layout share its chunk caches (``CostModel.share_chunk_caches``)."""
    first: dict[Layout, CostModel] = {}
    for layout, model in models.items():
        key = replace(layout, context=1, context_mode="ulysses")
        if key in first:
            model.share_chunk_caches(first[key])
        else:
            first[key] = model


def context_note_of(by_layout: dict[Layout, Candidate]) -> str:
    """A clause for the why-line when only context-parallel layouts had a fitting candidate."""
    if by_layout and all(layout.context > 1 for layout in by_layout):
        degrees = sorted({layout.context for layout in by_layout})
        return (
            "; no layout without context parallelism fits, so only context degrees "
            f"{', '.join(map(str, degrees))} have plans (each rank computes 1/C of every sequence)"
        )
    return ""
