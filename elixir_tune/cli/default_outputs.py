"""The files ``profile`` and ``search`` write when no ``--out`` is given: ./profile.yaml and ./plan.yaml.

Every command reads and writes these two by default, so following the README's commands in order once replaced
the quick start's 2-worker plan with a 4096-GPU one, and the next ``elixir-run plan.yaml pretrain`` failed. A
default output that already holds another model's profile, or another plan (another model, cluster, batch or
settings), is therefore not replaced: the command stops and says what the file holds and what to do. An
identical re-run replaces its own file, and ``--out`` naming the file, or ``--force``, replaces any.
"""

from __future__ import annotations

from pathlib import Path

import click
from click.core import ParameterSource

from elixir_tune.cli.console import EXIT_USAGE, fail

# The plan's sections an identical search writes alike, in words (prediction and search hold timings).
PLAN_SECTIONS = {
    "cluster": "cluster",
    "training": "batching or precision",
    "parallel": "parallel layout",
    "engine": "engine",
    "memory": "memory settings (chunks, caching, offload)",
}


def guards_default_output(option: str, force: bool) -> bool:
    """Whether the running command writes its default output (``option`` not given) without ``--force``.

    Args:
        option: the output option's parameter name (``out``, ``out_path``).
        force: whether ``--force`` was given.
    """
    source = click.get_current_context().get_parameter_source(option)
    return not force and source in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None)


def refuse_replacing_profile(out: str, profile) -> None:
    """Exits (usage) when ``out`` holds the profile of another model (another fingerprint), or no profile.

    Args:
        out: the default output, about to be written.
        profile: the ``ModelProfile`` about to be written there.
    """
    from elixir_tune.profiler.schema import load_profile

    if not Path(out).is_file():
        return
    try:
        held = load_profile(out)
    except (OSError, ValueError) as error:
        what = f"no profile this version reads ({_first_line(error)})"
    else:
        if held.fingerprint == profile.fingerprint:
            return
        what = f"the profile of {_model(held)}"
    fail(
        f"{out} holds {what}; this one is of {_model(profile)}",
        f"write it elsewhere with --out other.yaml (and search with --profile other.yaml), or replace {out} "
        "with --force",
        code=EXIT_USAGE,
    )


def refuse_replacing_plan(out: str, plan) -> None:
    """Exits (usage) when ``out`` holds another plan (another model fingerprint, cluster, batch or settings), or
    no plan.

    Args:
        out: the default output, about to be written.
        plan: the ``Plan`` about to be written there.
    """
    from elixir_tune.plan import PlanError, load_plan, plan_to_dict

    if not Path(out).is_file():
        return
    try:
        held = load_plan(out)
    except PlanError as error:
        what = f"no plan this version reads ({error.problems[0] if error.problems else error})"
    else:
        old, new = plan_to_dict(held), plan_to_dict(plan)
        differs = ["model"] if held.model.fingerprint != plan.model.fingerprint else []
        differs += [words for section, words in PLAN_SECTIONS.items() if old.get(section) != new.get(section)]
        if not differs:
            return
        what = f"another plan: {_summary(held)}, where this search's is {_summary(plan)}; they differ in " + ", ".join(
            differs
        )
    fail(
        f"{out} holds {what}",
        f"write it elsewhere with --out other.yaml, or replace {out} with --force",
        code=EXIT_USAGE,
    )


def _model(profile) -> str:
    """``llama (fingerprint 0123abcd...)``, with its LoRA rank: the same model with adapters is another one."""
    lora = f" with LoRA rank {profile.lora['rank']}" if profile.lora else ""
    return f"{profile.name}{lora} (fingerprint {profile.fingerprint})"


def _summary(plan) -> str:
    """``gpt2-tiny on 1 x 2 cpu, global batch 16``."""
    cluster = plan.cluster
    name = plan.model.name or plan.model.source
    return (
        f"{name} on {cluster.nodes} x {cluster.gpus_per_node} {cluster.hardware}, "
        f"global batch {plan.training.global_batch_size}"
    )


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
