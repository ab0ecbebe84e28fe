"""Peer candidates: the same data-parallel job on PyTorch FSDP2 or DeepSpeed ZeRO, priced by
``costmodel/peers.py`` and ranked beside our engine's candidates.

Each peer gets a few shapes of its own settings (FSDP2: resharding after forward or not, with and
without parameter offload; DeepSpeed: ZeRO stages 1-3, with optimizer and parameter offload), each
over the checkpointing and micro-batch choices our search tries. Offload is tried on GPU machines
only: on a CPU device the host is the device, so it frees nothing (as ``joint.offload_choices``).
A peer's plan records the model's parameter order in ``memory`` (our packing at one chunk size, no
per-chunk choices) and its settings in ``engine``, and passes ``validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from elixir_tune.costmodel.model import CostModel
from elixir_tune.costmodel.peers import PeerModel, PeerShape, describe
from elixir_tune.costmodel.shape import Shape
from elixir_tune.plan.engine_choice import ENGINE_NAMES, EngineChoice
from elixir_tune.plan.schema import Plan
from elixir_tune.search.candidate import Candidate, score_with
from elixir_tune.search.joint import Budget, checkpointing_choices, micro_batch_choices
from elixir_tune.search.space import chunk_size_grid

ENGINE_OPTIONS = (*ENGINE_NAMES, "any")
# Pins only our engine takes: a search of the peers alone refuses them.
CHUNK_ENGINE_PINS = ("chunk_size", "cache_blocks", "offload", "prefetch", "accumulation")
LAYOUT_PINS = ("pipeline", "tensor", "tensor_mode", "expert", "context", "assignment", "schedule")


@dataclass
class PeerCandidate(Candidate):
    """A candidate run by a peer engine.

    Attributes:
        engine: the engine and its settings.
    """

    engine: EngineChoice = field(default_factory=EngineChoice)

    def row(self) -> dict[str, Any]:
        """``Candidate.row`` with the engine; the chunk-engine columns describe the plan's parameter order only."""
        return {**super().row(), "engine": describe(self.engine), "offload": 0.0}


def engines_to_search(engine: str, pinned: dict[str, Any]) -> list[str]:
    """The engines a search covers: ``--engine`` (``any``: all three), or a ``--fix engine=`` pin.

    Raises:
        ValueError: an unknown engine, or ``--engine`` and the pin disagree.
    """
    if engine not in ENGINE_OPTIONS:
        raise ValueError(f"--engine {engine}: expected one of {', '.join(ENGINE_OPTIONS)}")
    fixed = pinned.get("engine")
    if fixed is not None and engine not in ("elixir", "any", fixed):
        raise ValueError(f"--fix engine={fixed} and --engine {engine} disagree: give one of them")
    if fixed is not None:
        return [fixed]
    return list(ENGINE_NAMES) if engine == "any" else [engine]


def check_peer_pins(engines: list[str], pinned: dict[str, Any]) -> None:
    """Refuses pins that no searched engine can take (the peers have no chunks and no model parallelism).

    Raises:
        ValueError: names the pin and what to do.
    """
    if "elixir" in engines:
        return
    for key in (*CHUNK_ENGINE_PINS, *LAYOUT_PINS):
        if key in pinned and not (key in ("pipeline", "tensor", "expert", "context") and pinned[key] == 1):
            raise ValueError(
                f"--fix {key}: a setting of our chunk engine or of model parallelism; engine "
                f"{' and '.join(engines)} runs data-parallel plans only (drop the pin, or search --engine any)"
            )


def engine_choices(name: str, model: CostModel) -> list[EngineChoice]:
    """The settings tried for one peer engine on this hardware."""
    gpu = model.hardware.device != "cpu"
    if name == "fsdp2":
        choices = [EngineChoice("fsdp2"), EngineChoice("fsdp2", reshard_after_forward=False)]
        if gpu:
            units = len(model.profile.blocks) + 1
            choices.append(EngineChoice("fsdp2", offload_params=True, offload_optimizer=True))
            if units > 2:
                choices.append(
                    EngineChoice("fsdp2", offload_params=True, offload_optimizer=True, offload_units=units // 2)
                )
        return choices
    if name == "deepspeed":
        choices = [EngineChoice("deepspeed", zero_stage=stage) for stage in (1, 2, 3)]
        if gpu:
            choices.append(EngineChoice("deepspeed", zero_stage=2, offload_optimizer=True))
            choices.append(EngineChoice("deepspeed", zero_stage=3, offload_optimizer=True))
            choices.append(EngineChoice("deepspeed", zero_stage=3, offload_params=True, offload_optimizer=True))
        return choices
    raise ValueError(f"engine {name}: not a peer engine")


@dataclass
class PeerExploration:
    """What the peers' search found.

    Attributes:
        candidates: every fitting candidate, fastest first.
        num_scored: candidates priced.
        min_gpu_bytes: the least device memory any candidate needed (None: none priced).
        min_host_bytes: the least host memory of those that fit the device.
    """

    candidates: list[PeerCandidate]
    num_scored: int
    min_gpu_bytes: int | None
    min_host_bytes: int | None


def explore_peers(model: CostModel, budget: Budget, pinned: dict[str, Any], engines: list[str]) -> PeerExploration:
    """Prices every peer shape of ``engines`` on the data-parallel ``model``.

    Args:
        model: the data-parallel cost model.
        budget: memory limits and the global batch.
        pinned: pinned choices (``micro_batch_size``, ``checkpointing`` and ``dtype`` apply).
        engines: peer engine names.

    Returns:
        The fitting candidates, fastest first, and the memory the smallest needed.
    """
    peers = PeerModel(model)
    world = model.world_size
    per_rank = budget.global_batch_size // world
    one_pool = model.hardware.device == "cpu"
    found = PeerExploration([], 0, None, None)
    plan_chunk = _plan_chunk_size(model)
    for name in engines:
        for engine in engine_choices(name, model):
            for every in checkpointing_choices(model, pinned):
                for micro in micro_batch_choices(per_rank, pinned):
                    shape = PeerShape(engine, micro, per_rank // micro, every)
                    memory = peers.memory(shape)
                    found.num_scored += 1
                    need = memory.required_gpu_bytes
                    if found.min_gpu_bytes is None or need < found.min_gpu_bytes:
                        found.min_gpu_bytes = need
                    if need > budget.usable_gpu_bytes:
                        continue
                    host = need * model.gpus_per_node + memory.peak_host_bytes if one_pool else memory.peak_host_bytes
                    if found.min_host_bytes is None or host < found.min_host_bytes:
                        found.min_host_bytes = host
                    if host > budget.host_bytes:
                        continue
                    estimate = peers.step_time(shape)
                    layout_shape = Shape(
                        plan_chunk, model.layout(plan_chunk).num_chunks, 0, 1, every, micro, shape.grad_accum_steps
                    )
                    base = score_with(model, layout_shape, memory, estimate, budget.global_batch_size)
                    found.candidates.append(PeerCandidate(**vars(base), engine=engine))
    found.candidates.sort(key=lambda c: rank_key(c, model))
    return found


def rank_key(candidate: Candidate, model: CostModel) -> tuple:
    """``Candidate.rank_key``, with device and host as one pool on a CPU device (as ``joint._TopK``)."""
    gpu, host = candidate.memory.peak_gpu_bytes, candidate.memory.peak_host_bytes
    if model.hardware.device == "cpu":
        gpu = host = gpu * model.gpus_per_node + host
    return candidate.rank_key(gpu, host)


def _plan_chunk_size(model: CostModel) -> int:
    """The chunk size whose packing records the parameter order in a peer's plan: the largest of the grid
    (fewest chunks)."""
    trainable = sum(p.numel for p in model.profile.params if p.requires_grad)
    return chunk_size_grid(model.largest_numel, trainable, model.data_size)[-1]


def engine_of(candidate: Candidate) -> str:
    """The engine name of a candidate (ours unless a ``PeerCandidate``)."""
    return candidate.engine.name if isinstance(candidate, PeerCandidate) else "elixir"


def peer_plan(plan: Plan, candidate: PeerCandidate) -> Plan:
    """A plan built from a peer candidate (``build_plan``) made the peer's: its engine section, and no
    per-chunk offload or resident choices (the peers cannot express them)."""
    chunks = [replace(chunk, offload=False, resident=False) for chunk in plan.memory.chunks]
    # Every chunk cached, one ahead where there are two: a chunk plan the peer ignores but validate reads
    # (a prefetch must leave room beside the chunk in use; a small model packs into one chunk).
    memory = replace(plan.memory, chunks=chunks, cache_blocks=len(chunks), prefetch=min(1, len(chunks) - 1))
    return replace(plan, engine=replace(candidate.engine), memory=memory)


def explain_engines(best: Candidate, bests: dict[str, Candidate], unit: str = "GiB") -> str:
    """Why the winner's engine: each searched engine's best predicted step and device memory.

    Args:
        best: the winning candidate.
        bests: the fastest fitting candidate of each engine searched (an engine with none is absent).
        unit: the memory unit named (GiB).

    Returns:
        A clause for the why-line ("" when one engine was searched).
    """
    if len(bests) <= 1 and engine_of(best) == "elixir":
        return ""
    parts = []
    for _name, candidate in sorted(bests.items(), key=lambda item: item[1].step_time_s):
        label = describe(candidate.engine) if isinstance(candidate, PeerCandidate) else "elixir"
        parts.append(f"{label} {candidate.step_time_s:.3g} s, {candidate.memory.peak_gpu_bytes / 2**30:.2f} {unit}")
    winner = engine_of(best)
    others = [c for name, c in bests.items() if name != winner]
    line = f"engine {winner}: best of each engine predicted " + "; ".join(parts)
    if others:
        runner = min(others, key=lambda c: c.step_time_s)
        line += (
            f" (the best other engine, {engine_of(runner)}, is {runner.step_time_s / best.step_time_s - 1:.1%} slower)"
        )
    return line


def explain_peer(best: PeerCandidate, device: str) -> str:
    """What the winning peer candidate does, in the why-line's first clause."""
    engine, shape, b = best.engine, best.shape, best.estimate.breakdown
    where = "the GPU" if device == "cuda" else "the device (CPU)"
    if engine.name == "fsdp2":
        what = (
            f"FSDP2, one fully_shard unit per block and the root, "
            f"{'resharded after forward (gathered again in backward)' if engine.reshard_after_forward else 'kept gathered from forward to backward'}"
        )
    else:
        what = f"DeepSpeed ZeRO-{engine.zero_stage}"
    if engine.offload_params or engine.offload_optimizer:
        what += ", optimizer step on the host" + (" with parameters offloaded" if engine.offload_params else "")
    return (
        f"{what} on {where}, micro-batch {shape.micro_batch_size} x {shape.grad_accum_steps}; compute is "
        f"{b.get('compute_s', 0.0) / best.step_time_s:.0%} of the step, {b.get('exposed_comm_s', 0.0):.3g} s of "
        "collectives exposed"
    )


def merge_ranked(
    ours: list[Candidate], theirs: list[PeerCandidate], model: CostModel, top_k: int
) -> tuple[list[Candidate], dict[str, Candidate]]:
    """Our engine's best candidates and the peers' in one ranking, and the best of each engine.

    Args:
        ours: our engine's best, fastest first (may be empty).
        theirs: the peers' fitting candidates, fastest first.
        model: the data-parallel cost model (the memory pools of the ranking).
        top_k: how many to keep.

    Returns:
        (the best ``top_k``, fastest first; {engine name: its fastest candidate}).
    """
    bests: dict[str, Candidate] = {}
    for candidate in [*ours[:1], *theirs]:
        bests.setdefault(engine_of(candidate), candidate)
    ranked = sorted([*ours, *theirs], key=lambda c: rank_key(c, model))
    return ranked[: max(1, top_k)], bests
