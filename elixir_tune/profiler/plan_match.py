"""A plan against the profile it was searched from: what ``validate`` alone cannot see.

A plan names its parameters and counts its chunks' elements, but only the profile knows the model:
which parameters exist, their sizes, the blocks and the positions the model takes. The search
writes the profile's path in ``search.profile``; ``elixir-tune validate`` and ``elixir-run``
compare the two before anything runs, so a hand-edited plan that leaves a parameter out, miscounts
a chunk or outruns the position table is refused before any worker starts. No torch here.
"""

from __future__ import annotations

from pathlib import Path

from elixir_tune.files import InputFileError
from elixir_tune.plan.memory import padded_offsets
from elixir_tune.profiler.schema import ModelProfile, load_profile


def profile_beside(raw_plan: dict, plan_path: str | Path) -> tuple[ModelProfile | None, str]:
    """The profile a plan was searched from, read from ``search.profile``.

    Args:
        raw_plan: the plan's mapping, as read from YAML.
        plan_path: where the plan is; a relative profile path is looked up beside it too.

    Returns:
        (profile, note): the profile, or None with a note saying why the plan was checked alone.
    """
    search = raw_plan.get("search")
    named = search.get("profile") if isinstance(search, dict) else None
    if not isinstance(named, str) or not named:
        return None, "the plan names no profile (search.profile), so it was checked alone"
    for candidate in (Path(named), Path(plan_path).parent / named):
        if candidate.is_file():
            try:
                profile = load_profile(candidate)
            except (InputFileError, ValueError) as error:
                return None, f"its profile {named} is unreadable ({error}), so the plan was checked alone"
            model = raw_plan.get("model")
            fingerprint = model.get("fingerprint") if isinstance(model, dict) else None
            if profile.fingerprint != fingerprint:
                return None, f"its profile {named} is now of another model, so the plan was checked alone"
            return profile, f"checked against its profile {named}"
    return None, f"its profile {named} is gone, so the plan was checked alone"


def plan_profile_problems(raw_plan: dict, profile: ModelProfile) -> list[str]:
    """What a plan says about its model that the model's profile contradicts.

    Args:
        raw_plan: a plan mapping that ``validate_dict`` accepts.
        profile: the profile it was searched from (the same fingerprint).

    Returns:
        One message per problem, each starting with the plan's field path; empty when they agree.
    """
    problems: list[str] = []
    model, training, memory = raw_plan["model"], raw_plan["training"], raw_plan["memory"]
    if model.get("num_blocks", 0) != len(profile.blocks):
        problems.append(
            f"model.num_blocks: {model.get('num_blocks', 0)}, but the model has {len(profile.blocks)} blocks "
            f"in {profile.block_list or 'no block list'}"
        )
    if profile.max_seq_len and training["seq_len"] > profile.max_seq_len:
        problems.append(
            f"training.seq_len: {training['seq_len']} tokens, but the model's position table holds "
            f"{profile.max_seq_len}; use at most {profile.max_seq_len}"
        )
    problems += _chunk_problems(memory["chunks"], profile, _splits_parameters(raw_plan.get("parallel") or {}))
    return problems


def _splits_parameters(parallel: dict) -> bool:
    """Tensor and expert parallelism give a rank a slice of some parameters: its chunks count slices."""
    tensor = parallel.get("tensor") or {}
    expert = parallel.get("expert") or {}
    return tensor.get("degree", 1) > 1 or expert.get("degree", 1) > 1


def _chunk_problems(chunks: list[dict], profile: ModelProfile, sliced: bool) -> list[str]:
    """Every trainable parameter in a chunk, no unknown one, and each chunk's elements as packed."""
    numel = {param.name: param.numel for param in profile.params}
    planned = [name for chunk in chunks for name in chunk.get("params", [])]
    problems = []
    missing = [p.name for p in profile.params if p.requires_grad and p.name not in set(planned)]
    if missing:
        problems.append(
            f"memory.chunks: {len(missing)} trainable parameter(s) in no chunk ({', '.join(missing[:3])}): "
            "the engine would refuse the plan; search again"
        )
    unknown = [name for name in planned if name not in numel]
    if unknown:
        problems.append(f"memory.chunks: the model has no parameter {unknown[0]!r}")
    if sliced or unknown:
        return problems  # a rank's chunk holds slices: their sizes are the tensor table's
    for index, chunk in enumerate(chunks):
        _, packed = padded_offsets([numel[name] for name in chunk.get("params", [])])
        if "numel" in chunk and chunk["numel"] != packed:
            problems.append(
                f"memory.chunks[{index}].numel: {chunk['numel']}, but its parameters packed span {packed} elements"
            )
    return problems
