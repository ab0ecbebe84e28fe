"""``search()``: from a profile and a hardware spec to the best plan."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from elixir_tune.costmodel.model import CostModel
from elixir_tune.costmodel.parallel import DATA_ONLY, Layout
from elixir_tune.hardware.spec import HardwareSpec
from elixir_tune.plan.capabilities import LOOP_CONTRACT, LOOPS, needs_forward_backward
from elixir_tune.plan.schema import Plan
from elixir_tune.profiler.schema import ModelProfile
from elixir_tune.search.candidate import Candidate, score
from elixir_tune.search.context_layouts import context_note_of, share_chunk_caches, without_dominated_modes
from elixir_tune.search.elixir_rule import fitted_elixir_shape
from elixir_tune.search.explain import explain_winner
from elixir_tune.search.joint import Budget, explore
from elixir_tune.search.layouts import layout_choices
from elixir_tune.search.peers import (
    PeerCandidate,
    check_peer_pins,
    engine_of,
    engines_to_search,
    explain_engines,
    explain_peer,
    explore_peers,
    merge_ranked,
    peer_plan,
)
from elixir_tune.search.plan_builder import build_plan
from elixir_tune.search.space import parse_fixed
from elixir_tune.units import gib, human_bytes

STRATEGIES = ("joint", "elixir")
DEFAULT_BATCH_PER_GPU = 8


class InfeasibleError(ValueError):
    """No configuration fits: carries what the smallest one needs and what to change.

    Attributes:
        required_gpu_bytes: device memory per rank of the smallest configuration (None if unknown).
        usable_gpu_bytes: what a rank may use.
        required_host_bytes: host memory per node the smallest device-fitting configuration needs.
        host_memory_bytes: host memory per node.
        suggestions: what the user can change.
    """

    def __init__(
        self,
        message: str,
        *,
        required_gpu_bytes: int | None,
        usable_gpu_bytes: int,
        required_host_bytes: int | None,
        host_memory_bytes: int,
        suggestions: list[str],
    ):
        self.required_gpu_bytes = required_gpu_bytes
        self.usable_gpu_bytes = usable_gpu_bytes
        self.required_host_bytes = required_host_bytes
        self.host_memory_bytes = host_memory_bytes
        self.suggestions = suggestions
        super().__init__(message)


@dataclass
class SearchResult:
    """What ``search`` returns.

    Attributes:
        plan: the best plan (passes ``validate``), with prediction and search info.
        candidates: the best candidates, fastest first (``candidates[0]`` is the plan's).
        elapsed_s: wall time of the search.
        num_scored: candidates whose step was simulated.
        why: one line on why the winner wins.
        model: the cost model of the winner's parallel layout (for explaining other candidates).
        models: the cost model of every parallel layout searched.
        best_by_layout: the fastest candidate scored of each parallel layout (joint search).
        usable_gpu_bytes: the device memory a rank could fill (the hardware's, or ``device_memory_bytes``).
    """

    plan: Plan
    candidates: list[Candidate]
    elapsed_s: float
    num_scored: int
    why: str
    model: CostModel
    models: dict[Layout, CostModel] = field(default_factory=dict)
    best_by_layout: dict[Layout, Candidate] = field(default_factory=dict)
    usable_gpu_bytes: int = 0

    def model_of(self, candidate: Candidate) -> CostModel:
        """The cost model a candidate was scored with."""
        return self.models.get(candidate.layout, self.model)

    @property
    def candidates_per_s(self) -> float:
        return self.num_scored / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class _Pools:
    """The memory limits a search ran under, for its error when nothing fits.

    Attributes:
        usable_gpu_bytes: device memory a rank may fill.
        host_bytes: host memory of a node.
        one_pool: the device is the CPU, so its memory is the host's.
        offload_pinned: ``--fix offload`` was given (the device need is at that share).
    """

    usable_gpu_bytes: int
    host_bytes: int
    one_pool: bool = False
    offload_pinned: bool = False


def _size(num_bytes: int) -> str:
    """Sizes in the errors: GiB with two decimals (they compare), or smaller units below 1 GiB."""
    return gib(num_bytes) if num_bytes >= 2**30 else human_bytes(num_bytes)


def _infeasible(required_gpu: int | None, required_host: int | None, pools: _Pools, fixed: dict) -> InfeasibleError:
    """The error for no fitting configuration, naming the pool that is short and by how much."""
    usable, host = pools.usable_gpu_bytes, pools.host_bytes
    device = "device memory (CPU RAM share)" if pools.one_pool else "device memory"
    suggestions: list[str] = []
    if required_gpu is None:
        message = "the pinned choices (--fix) leave no possible configuration"
        suggestions.append("pin fewer choices with --fix, or pick values the model allows")
    elif required_gpu > usable:
        offload = (
            f"the pinned offload share {fixed['offload']:g} of the shards on the host"
            if pools.offload_pinned
            else "every shard on the host"
        )
        if pools.one_pool:
            offload = "no offload: offload frees nothing on a CPU device, whose host is its memory"
        message = (
            f"nothing fits the device: the smallest configuration needs {_size(required_gpu)} of {device} per "
            f"rank ({offload}, the smallest cache, chunk and micro-batch, activation checkpointing unless "
            f"pinned off), but only {_size(usable)} is usable"
        )
        if pools.offload_pinned and not pools.one_pool:
            suggestions.append("a larger --fix offload share, or drop the pin")
        suggestions.append("more GPUs (--gpus / --nodes): shards shrink with the world size")
        suggestions.append("a smaller batch (--global-batch-size, or --fix micro_batch_size=1)")
        if fixed.get("checkpointing", 1) != 1:  # unpinned, the search already tried it
            suggestions.append("activation checkpointing (--fix checkpointing=all)")
        if fixed:
            suggestions.append("fewer --fix pins (let the search choose chunk size and cache)")
    else:
        what = (
            "for every rank's share of the device and the offloaded shards (a CPU device is host memory)"
            if pools.one_pool
            else "for offloaded shards and their copy buffers"
        )
        message = (
            f"nothing fits the host: the configurations that fit the device need {_size(required_host or 0)} "
            f"of host memory per node {what}, but only {_size(host)} is available"
        )
        suggestions.append("more host memory (--host-memory BYTES if the machine has it)")
        suggestions.append("more GPUs (--gpus / --nodes): fewer shards offloaded per node")
        suggestions.append("a smaller batch or activation checkpointing, so that more shards stay on the GPU")
    return InfeasibleError(
        message + "; try: " + "; ".join(suggestions),
        required_gpu_bytes=required_gpu,
        usable_gpu_bytes=usable,
        required_host_bytes=required_host,
        host_memory_bytes=host,
        suggestions=suggestions,
    )


def _pins_of_loop(pinned: dict[str, Any], loop: str) -> dict[str, Any]:
    """The pins the search runs with: the user's, plus what the script's loop rules out.

    Raises:
        ValueError: an unknown loop, or a pin the plain loop cannot run (says what to pass).
    """
    if loop not in LOOPS:
        raise ValueError(f"unknown loop {loop!r} (known: {', '.join(LOOPS)})")
    if loop == "forward_backward":
        return pinned
    needs = needs_forward_backward(pinned.get("pipeline", 1), pinned.get("tensor", 1), pinned.get("accumulation", ""))
    if needs or pinned.get("tensor_mode") == "2d":
        shown = ", ".join(
            f"--fix {key}={pinned[key]}"
            for key in ("pipeline", "tensor", "tensor_mode", "accumulation")
            if key in pinned
        )
        raise ValueError(
            f"{shown}: needs a training script that runs {LOOP_CONTRACT['forward_backward']}; if yours does, add "
            f"--loop forward_backward (the plain loop, {LOOP_CONTRACT['plain']}, runs data parallelism with "
            "standard accumulation only)"
        )
    return {**pinned, "pipeline": 1, "tensor": 1, "accumulation": "standard"}


def search(
    profile: ModelProfile,
    hardware: HardwareSpec,
    gpus_per_node: int,
    nodes: int = 1,
    global_batch_size: int | None = None,
    host_memory_bytes: int | None = None,
    fixed: dict[str, Any] | list[str] | None = None,
    top_k: int = 5,
    strategy: str = "joint",
    hardware_id: str | None = None,
    loop: str = "plain",
    device_memory_bytes: int | None = None,
    profile_path: str = "",
    engine: str = "elixir",
) -> SearchResult:
    """Finds the fastest plan that fits.

    Args:
        profile: the model profile.
        hardware: the node spec.
        gpus_per_node: ranks per node.
        nodes: nodes.
        global_batch_size: samples per step over all ranks (default 8 per GPU).
        host_memory_bytes: host memory per node (default: the spec's).
        fixed: pinned choices, a mapping or KEY=VALUE strings (see ``space.FIX_KEYS``).
        top_k: how many of the best candidates to keep.
        strategy: "joint" (our search) or "elixir" (Elixir's rule, scored by our cost model).
        hardware_id: what the plan records as ``cluster.hardware`` (default: the spec's name).
        loop: what the training script runs each step (``plan/capabilities.py``): ``plain``
            (``model(**batch)`` + ``optimizer.backward``) limits the search to data parallelism with
            standard accumulation; ``forward_backward`` also tries pipeline, tensor and layered plans.
        device_memory_bytes: caps the device memory a rank may fill (default: the spec's usable).
        profile_path: the profile's file, recorded in the plan (``search.profile``) for ``show``.
        engine: who may run the plan: ``elixir`` (our engine, the default: the search as it always
            was), ``fsdp2``, ``deepspeed`` (data parallelism only, ``search/peers.py``) or ``any``
            (all three ranked together); a ``--fix engine=`` pin narrows it.

    Returns:
        The result; ``result.plan`` passes ``validate``.

    Raises:
        InfeasibleError: nothing fits (the error carries the memory the smallest configuration needs).
        ValueError: a bad argument or pinned choice.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    if gpus_per_node < 1 or nodes < 1:
        raise ValueError("gpus_per_node and nodes must be positive")
    started = time.perf_counter()
    pinned = parse_fixed(fixed)
    engines = engines_to_search(engine, pinned)
    check_peer_pins(engines, pinned)
    if strategy == "elixir" and engines != ["elixir"]:
        raise ValueError("--strategy elixir scores our engine's plans only; drop --engine / --fix engine")
    searched = _pins_of_loop(pinned, loop)
    world = gpus_per_node * nodes
    global_batch = global_batch_size or DEFAULT_BATCH_PER_GPU * world
    if "elixir" not in engines:
        if global_batch % world:
            raise ValueError(f"global batch size {global_batch} is not a multiple of the {world} GPUs")
        layouts = [DATA_ONLY]
    elif strategy == "elixir":
        if global_batch % world:
            raise ValueError(f"global batch size {global_batch} is not a multiple of the {world} GPUs")
        if any(key in pinned for key in ("pipeline", "tensor", "tensor_mode", "expert", "context")):
            raise ValueError(
                "--strategy elixir: Elixir's rule has no pipeline, tensor, expert or context parallelism; drop those pins"
            )
        layouts = [DATA_ONLY]
    else:
        layouts = layout_choices(profile, gpus_per_node, nodes, global_batch, searched)
    models = without_dominated_modes(
        {
            layout: CostModel(profile, hardware, gpus_per_node, nodes, dtype=pinned.get("dtype"), layout=layout)
            for layout in layouts
        }
    )
    share_chunk_caches(models)
    model = next(iter(models.values()))
    host_bytes = host_memory_bytes if host_memory_bytes is not None else hardware.host_memory_bytes
    usable = hardware.usable_memory_bytes
    if device_memory_bytes is not None:
        usable = min(usable, device_memory_bytes)
    budget = Budget(usable_gpu_bytes=usable, host_bytes=host_bytes, global_batch_size=global_batch)
    pools = _Pools(budget.usable_gpu_bytes, host_bytes, hardware.device == "cpu", "offload" in pinned)
    by_layout: dict[Layout, Candidate] = {}
    context_note = ""
    peers = None
    if engines != ["elixir"]:
        data_model = models.get(DATA_ONLY) or CostModel(
            profile, hardware, gpus_per_node, nodes, dtype=pinned.get("dtype"), layout=DATA_ONLY
        )
        models.setdefault(DATA_ONLY, data_model)
        peers = explore_peers(data_model, budget, searched, [name for name in engines if name != "elixir"])
    candidates: list[Candidate] = []
    num_scored = 0
    if "elixir" not in engines:
        pass
    elif strategy == "joint":
        found = explore(list(models.values()), budget, searched, top_k)
        if any(layout.context == 1 for layout in models):  # searched first: absent only where nothing fit
            context_note = context_note_of(found.best_by_layout)
        if not found.best and not (peers and peers.candidates):
            raise _infeasible(found.min_gpu_bytes, found.min_host_bytes, pools, pinned)
        candidates, num_scored, by_layout = found.best, found.num_scored, found.best_by_layout
        model = models[candidates[0].layout] if candidates else model
    else:
        shape, memory = fitted_elixir_shape(model, global_batch // world, budget.usable_gpu_bytes, searched)
        host_need = memory.peak_host_bytes
        if pools.one_pool:
            host_need += memory.required_gpu_bytes * gpus_per_node
        if memory.required_gpu_bytes > budget.usable_gpu_bytes or host_need > host_bytes:
            raise _infeasible(memory.required_gpu_bytes, host_need, pools, pinned)
        candidates, num_scored = [score(model, shape, memory, global_batch)], 1
    bests: dict[str, Candidate] = {"elixir": candidates[0]} if candidates else {}
    ours = candidates
    if peers is not None:
        if not peers.candidates and not candidates:
            raise _infeasible(peers.min_gpu_bytes, peers.min_host_bytes, pools, pinned)
        candidates, bests = merge_ranked(ours, peers.candidates, models[DATA_ONLY], top_k)
        num_scored += peers.num_scored
        model = models[DATA_ONLY] if engine_of(candidates[0]) != "elixir" else model
    best = candidates[0]
    if isinstance(best, PeerCandidate):
        why = explain_peer(best, hardware.device)
    else:
        why = explain_winner(ours, pinned, device=hardware.device, by_layout=by_layout, layouts_tried=len(models))
    engines_line = explain_engines(best, bests) if peers is not None else ""
    why += ("; " + engines_line if engines_line else "") + context_note
    if loop == "plain" and strategy == "joint" and len(profile.layout_reasons()) < 2:
        why += (
            "; the plain loop runs data parallelism with standard accumulation only (--loop forward_backward "
            "also tries pipeline, tensor and layered plans)"
        )
    elapsed = time.perf_counter() - started
    alternatives = candidates[1:] + [c for c in bests.values() if all(c is not kept for kept in candidates)]
    plan = build_plan(
        model,
        candidates[0],
        hardware_id=hardware_id or hardware.name,
        global_batch_size=global_batch,
        strategy=strategy,
        elapsed_s=elapsed,
        num_scored=num_scored,
        alternatives=alternatives,
        loop=loop,
        usable_gpu_bytes=budget.usable_gpu_bytes,
        profile_path=profile_path,
    )
    if isinstance(best, PeerCandidate):
        plan = peer_plan(plan, best)
    return SearchResult(
        plan=plan,
        candidates=candidates,
        elapsed_s=elapsed,
        num_scored=num_scored,
        why=why,
        model=model,
        models=models,
        best_by_layout=by_layout,
        usable_gpu_bytes=budget.usable_gpu_bytes,
    )
