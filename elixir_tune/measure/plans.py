"""The plans ``search --measure`` tries: the search's best few, and each peer engine's nearest
configuration to the winner (same micro-batch and checkpointing where one fits, else its fastest).
Imports no torch."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from elixir_tune.costmodel.parallel import DATA_ONLY
from elixir_tune.costmodel.peers import describe
from elixir_tune.plan.schema import Plan
from elixir_tune.search.candidate import Candidate
from elixir_tune.search.driver import SearchResult
from elixir_tune.search.joint import Budget
from elixir_tune.search.peers import PeerCandidate, engine_of, explore_peers, peer_plan
from elixir_tune.search.plan_builder import build_plan

PEER_ENGINES = ("fsdp2", "deepspeed")
# Where the peer runners live once merged (plan/engine_choice.py), and what DeepSpeed's needs besides.
PEER_RUNNER_MODULE = "elixir_tune.engine.peers"


@dataclass
class CandidatePlan:
    """A plan to measure.

    Attributes:
        name: e.g. ``#1 elixir``, ``#2 fsdp2 reshard`` or ``nearest deepspeed z3``.
        candidate: the scored candidate.
        plan: its plan (validates).
    """

    name: str
    candidate: Candidate
    plan: Plan

    @property
    def engine(self) -> str:
        return engine_of(self.candidate)


def runner_missing(engine: str) -> str | None:
    """Why this elixir-tune cannot run a plan of ``engine`` (None when it can)."""
    if engine == "elixir":
        return None
    if not _module_exists(PEER_RUNNER_MODULE):
        return (
            f"engine {engine}'s runner (elixir_tune/engine/peers/) is not in this elixir-tune; "
            "its prediction stands unmeasured"
        )
    if engine == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "engine deepspeed needs DeepSpeed: pip install deepspeed"
    return None


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def plan_of(result: SearchResult, candidate: Candidate) -> Plan:
    """The plan of any candidate of a search, as the search writes its winner's."""
    base = result.plan
    assert base.search is not None, "a search's plan records how it was found"
    plan = build_plan(
        result.model_of(candidate),
        candidate,
        hardware_id=base.cluster.hardware,
        global_batch_size=base.training.global_batch_size,
        strategy=base.search.strategy,
        elapsed_s=base.search.elapsed_s,
        num_scored=base.search.candidates,
        alternatives=[],
        loop=base.training.loop or "plain",
        usable_gpu_bytes=result.usable_gpu_bytes,
        profile_path=base.search.profile,
    )
    return peer_plan(plan, candidate) if isinstance(candidate, PeerCandidate) else plan


def plans_to_measure(result: SearchResult, top: int, host_bytes: int, peers: bool = True) -> list[CandidatePlan]:
    """The search's best ``top`` candidates, then each peer engine's nearest configuration to the winner.

    Args:
        result: the search's result.
        top: how many of its best to try.
        host_bytes: host memory per node the search planned with.
        peers: also the peer engines' nearest configurations.

    Returns:
        The plans, the search's order first.
    """
    chosen = [
        CandidatePlan(f"#{rank} {_label(candidate)}", candidate, plan_of(result, candidate))
        for rank, candidate in enumerate(result.candidates[:top], 1)
    ]
    if not peers or DATA_ONLY not in result.models:
        return chosen
    model = result.models[DATA_ONLY]
    budget = Budget(result.usable_gpu_bytes, host_bytes, result.plan.training.global_batch_size)
    winner = result.candidates[0].shape
    present = {plan.engine for plan in chosen}
    for engine in PEER_ENGINES:
        if engine in present:
            continue
        found = explore_peers(model, budget, {}, [engine]).candidates
        if not found:
            continue
        same = [
            c for c in found if (c.shape.micro_batch_size, c.shape.every) == (winner.micro_batch_size, winner.every)
        ]
        nearest = (same or found)[0]
        chosen.append(CandidatePlan(f"nearest {_label(nearest)}", nearest, plan_of(result, nearest)))
    return chosen


def _label(candidate: Candidate) -> str:
    return describe(candidate.engine) if isinstance(candidate, PeerCandidate) else "elixir"
