"""Time to train: over cluster sizes and the batch the scaling laws allow, the fastest (or cheapest) run.

``search`` answers "with this cluster and this global batch, which plan is fastest per step".
``time_to_train`` asks it for each cluster size of a frontier and turns each answer into the
run's figures: steps = ceil(D / (batch x seq_len)), time = steps x step time, GPU-hours =
GPUs x time. The global batch is bounded by the batch limit (``scaling.py``: Kaplan et al.'s
critical batch at the run's final loss, or ``--batch-limit``).

Cluster sizes: whole nodes 1, 2, 4, ... up to ``max_gpus`` (below one node: 1, 2, 4, ... GPUs of
one node), so the sizes searched for a larger ``max_gpus`` include those of a smaller one and the
best answer never gets worse with more GPUs. Each size is searched at one global batch: the largest
that the limit allows and that data parallelism over the whole cluster, or over a power-of-two
share of it, divides (a larger batch at a fixed cluster amortises the per-step costs: gradient
reduction, pipeline fill, fetches per pass). The time leaves out data loading, evaluation,
checkpoints, failures and restarts.

``methods=False`` searches without the two methods of Lamy-Poirier 2021 (arXiv 2106.02679):
standard accumulation without a pipeline, or contiguous pipeline stages (GPipe or 1F1B, as
Megatron-LM runs them), so that their effect on the shortest time can be measured.

This module imports no torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elixir_tune.hardware.spec import HardwareSpec
from elixir_tune.profiler.schema import ModelProfile
from elixir_tune.search.driver import InfeasibleError, SearchResult, search
from elixir_tune.search.scaling import BatchLimit, batch_limit
from elixir_tune.search.space import parse_fixed

OBJECTIVES = ("time", "gpu-hours")
SECONDS_PER_DAY = 86400.0


@dataclass
class ClusterAnswer:
    """The best run on one cluster size (or why there is none).

    Attributes:
        nodes: nodes.
        gpus_per_node: GPUs per node.
        global_batch_size: samples per optimizer step (0 when no batch is possible).
        seq_len: tokens per sample.
        train_tokens: the token budget D.
        result: the search's answer for this cluster and batch (None when nothing ran).
        problem: why there is no answer ("" when there is).
        search_s: seconds spent searching this cluster.
        bound_s: the least time the cost model could predict on this cluster (every step at the
            hardware's best published MFU; 0 when the hardware has none): a size left unsearched
            because this is above the best time found shows it instead.
    """

    nodes: int
    gpus_per_node: int
    global_batch_size: int
    seq_len: int
    train_tokens: int
    result: SearchResult | None = None
    problem: str = ""
    search_s: float = 0.0
    bound_s: float = 0.0

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def ok(self) -> bool:
        return self.result is not None

    @property
    def batch_tokens(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def steps(self) -> int:
        """Optimizer steps to see at least ``train_tokens``."""
        return math.ceil(self.train_tokens / self.batch_tokens) if self.batch_tokens else 0

    @property
    def step_time_s(self) -> float:
        return self.result.candidates[0].step_time_s if self.result else math.inf

    @property
    def tokens_per_s(self) -> float:
        return self.result.candidates[0].tokens_per_s if self.result else 0.0

    @property
    def time_s(self) -> float:
        """Wall time of the training steps (nothing else: no data loading, evaluation or restarts)."""
        return self.steps * self.step_time_s if self.result else math.inf

    @property
    def days(self) -> float:
        return self.time_s / SECONDS_PER_DAY

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.time_s / 3600.0

    @property
    def layout(self) -> str:
        return self.result.candidates[0].layout.describe() if self.result else ""

    def key(self, objective: str) -> tuple[float, float, int]:
        """What the objective ranks by, smaller first (ties: the other measure, then fewer GPUs)."""
        if objective == "time":
            return (self.time_s, self.gpu_hours, self.gpus)
        return (self.gpu_hours, self.time_s, self.gpus)

    def row(self, gpu_hour_price: float | None = None) -> dict[str, Any]:
        """A flat mapping for tables and JSON."""
        out: dict[str, Any] = {
            "nodes": self.nodes,
            "gpus": self.gpus,
            "global_batch_size": self.global_batch_size,
            "batch_tokens": self.batch_tokens,
            "problem": self.problem,
        }
        if self.bound_s > 0:
            out["bound_days"] = round(self.bound_s / SECONDS_PER_DAY, 3)
        if self.result:
            best = self.result.candidates[0]
            out.update(
                steps=self.steps,
                step_time_s=round(self.step_time_s, 6),
                tokens_per_s=round(self.tokens_per_s, 2),
                time_s=round(self.time_s, 1),
                days=round(self.days, 3),
                gpu_hours=round(self.gpu_hours, 1),
                mfu=round(best.mfu, 4),
                layout=self.layout,
                micro_batch_size=best.shape.micro_batch_size,
                grad_accum_steps=best.shape.grad_accum_steps,
                accumulation=best.shape.accumulation,
                search_s=round(self.search_s, 2),
            )
            if gpu_hour_price is not None:
                out["cost"] = round(self.gpu_hours * gpu_hour_price, 2)
        return out


@dataclass
class TimeToTrain:
    """What ``time_to_train`` returns.

    Attributes:
        limit: the batch limit the batches were bounded by.
        train_tokens: the token budget D.
        objective: ``time`` or ``gpu-hours``.
        frontier: one answer per cluster size searched, smallest first.
        best: the winner under the objective (None when no size has an answer).
        elapsed_s: wall time of the whole search.
        gpu_hour_price: price of one GPU-hour, for the cost column (None: not asked).
    """

    limit: BatchLimit
    train_tokens: int
    objective: str
    frontier: list[ClusterAnswer]
    best: ClusterAnswer | None
    elapsed_s: float
    gpu_hour_price: float | None = None


def cluster_sizes(gpus_per_node: int, max_gpus: int) -> list[tuple[int, int]]:
    """(nodes, GPUs per node) to search: 1, 2, 4, ... nodes up to ``max_gpus``; a single node's
    1, 2, 4, ... GPUs when ``max_gpus`` is below one node.

    Raises:
        ValueError: a non-positive ``max_gpus`` or GPUs per node.
    """
    if max_gpus < 1 or gpus_per_node < 1:
        raise ValueError(f"--max-gpus {max_gpus}: expected at least 1 GPU")
    if max_gpus < gpus_per_node:
        return [(1, 1 << k) for k in range(max_gpus.bit_length()) if 1 << k <= max_gpus]
    most_nodes = max_gpus // gpus_per_node
    return [(1 << k, gpus_per_node) for k in range(most_nodes.bit_length()) if 1 << k <= most_nodes]


def largest_batch(world: int, limit_samples: int) -> int:
    """The largest global batch (samples) at most ``limit_samples`` that ``world`` or a power-of-two
    share of it (``world / 2^k``, the data degree left beside pipeline or tensor parallelism)
    divides; 0 when not even one sample per such share fits."""
    share = world
    while share > limit_samples and share % 2 == 0:
        share //= 2
    if share > limit_samples:
        return 0
    return (limit_samples // share) * share


def time_bound_s(profile: ModelProfile, hardware: HardwareSpec, world: int, batch: int, steps: int) -> float:
    """The least training time the cost model can predict: every step's model FLOPs at the
    hardware's best published MFU of its datasheet peak (the plausibility bound a prediction is
    never faster than, ``costmodel/rates.py``); 0 when the hardware has no best MFU or peak."""
    best = hardware.best_mfu.get(profile.dtype, 0.0)
    peak_tflops = hardware.matmul_peak_tflops.get(profile.dtype, 0.0)
    if best <= 0 or peak_tflops <= 0:
        return 0.0
    return steps * profile.flops_per_sample * batch / world / (best * peak_tflops * 1e12)


def _search_cluster(
    profile: ModelProfile,
    hardware: HardwareSpec,
    nodes: int,
    gpus_per_node: int,
    batch: int,
    pin_sets: list[dict[str, Any]],
    user_fixed: dict[str, Any],
    search_kwargs: dict[str, Any],
) -> tuple[SearchResult | None, str]:
    """The fastest of ``search`` under each pin set (beside the user's pins), or why none had an answer."""
    best: SearchResult | None = None
    problems: list[str] = []
    for pins in pin_sets:
        try:
            result = search(
                profile,
                hardware,
                gpus_per_node=gpus_per_node,
                nodes=nodes,
                global_batch_size=batch,
                fixed={**user_fixed, **pins},
                **search_kwargs,
            )
        except InfeasibleError as error:
            problems.append(str(error).split("; try:")[0])
            continue
        except ValueError as error:  # no layout divides this batch, or a pin this cluster cannot take
            problems.append(str(error))
            continue
        if best is None or result.candidates[0].step_time_s < best.candidates[0].step_time_s:
            best = result
    return best, "" if best else (problems[0] if problems else "no layout")


def _pin_sets(profile: ModelProfile, world: int, methods: bool) -> list[dict[str, Any]]:
    """The searches one cluster takes: one free search, or without the seed's methods one with
    standard accumulation (no pipeline) and one per pipeline degree with contiguous stages."""
    if methods:
        return [{}]
    num_blocks = len(profile.blocks)
    degrees = [p for p in range(2, min(world, num_blocks) + 1) if world % p == 0]
    return [{"accumulation": "standard"}] + [{"pipeline": p, "assignment": "contiguous"} for p in degrees]


def time_to_train(
    profile: ModelProfile,
    hardware: HardwareSpec,
    train_tokens: int,
    *,
    max_gpus: int | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    objective: str = "time",
    batch_limit_tokens: float | None = None,
    global_batch_size: int | None = None,
    gpu_hour_price: float | None = None,
    methods: bool = True,
    full_frontier: bool = False,
    progress: Callable[[str], None] | None = None,
    **search_kwargs: Any,
) -> TimeToTrain:
    """The fastest (or fewest GPU-hours) way to train ``profile`` on ``train_tokens`` tokens.

    Args:
        profile: the model.
        hardware: the node spec (``--network`` already applied).
        train_tokens: D, tokens to train on.
        max_gpus: search whole-node clusters up to this many GPUs (``cluster_sizes``).
        nodes: a fixed number of nodes (with ``gpus_per_node``: only this cluster).
        gpus_per_node: GPUs per node (default: the hardware's).
        objective: ``time`` (shortest) or ``gpu-hours`` (fewest).
        batch_limit_tokens: the user's batch limit in tokens (default: the scaling law's).
        global_batch_size: a fixed global batch in samples (must be within the limit).
        gpu_hour_price: price per GPU-hour, for the cost figures.
        methods: False searches without layered accumulation and modular pipelines (``_pin_sets``).
        full_frontier: search every size; by default the ``time`` objective skips a size whose
            ``time_bound_s`` is already slower than the best found (its row shows the bound).
        progress: called with a line as each size starts.
        **search_kwargs: passed to ``search`` (loop, fixed, host_memory_bytes, hardware_id, ...).

    Returns:
        The frontier and the winner.

    Raises:
        ValueError: bad arguments (a message that says what to pass).
    """
    started = time.perf_counter()
    if objective not in OBJECTIVES:
        raise ValueError(f"--objective {objective}: expected one of {', '.join(OBJECTIVES)}")
    if train_tokens < 1:
        raise ValueError(f"--train-tokens {train_tokens}: expected a positive number of tokens, e.g. 300e9")
    if gpu_hour_price is not None and gpu_hour_price < 0:
        raise ValueError(f"--gpu-hour-price {gpu_hour_price}: expected a price of at least 0")
    per_node = gpus_per_node or hardware.gpus_per_node
    if nodes is not None:
        sizes = [(nodes, per_node)]
    elif max_gpus is not None:
        sizes = cluster_sizes(per_node, max_gpus)
    else:
        raise ValueError("give --max-gpus G to search cluster sizes, or --gpus (and --nodes) for one cluster")
    user_fixed = parse_fixed(search_kwargs.pop("fixed", None))
    limit = batch_limit(profile, train_tokens, batch_limit_tokens)
    limit_samples = limit.samples(profile.seq_len)
    if global_batch_size is not None and global_batch_size > limit_samples:
        raise ValueError(
            f"--global-batch-size {global_batch_size}: more than the batch limit of {limit_samples} samples "
            f"({limit.tokens:,.0f} tokens of {profile.seq_len}); lower it, or raise the limit with --batch-limit TOKENS"
        )
    frontier: list[ClusterAnswer] = []
    best: ClusterAnswer | None = None
    # The shortest time: the largest cluster first, so that a smaller one whose bound is already
    # slower than the best found is not searched (its search is the slowest: the most micro-batches).
    prune = objective == "time" and not full_frontier
    for size_nodes, size_gpus in reversed(sizes) if prune else sizes:
        world = size_nodes * size_gpus
        batch = global_batch_size or largest_batch(world, limit_samples)
        answer = ClusterAnswer(size_nodes, size_gpus, batch, profile.seq_len, train_tokens)
        if batch == 0:
            answer.problem = (
                f"the batch limit of {limit_samples} samples leaves less than one sample per data-parallel rank"
            )
            frontier.append(answer)
            continue
        answer.bound_s = time_bound_s(profile, hardware, world, batch, answer.steps)
        if prune and best is not None and answer.bound_s > best.time_s:
            answer.problem = (
                f"not searched: even at the hardware's best MFU it takes {answer.bound_s / SECONDS_PER_DAY:.3g} "
                f"days, more than the {best.days:.3g} of {best.gpus} GPUs"
            )
            frontier.append(answer)
            continue
        if progress:
            progress(f"{size_nodes} x {size_gpus} GPUs, global batch {batch}")
        cluster_started = time.perf_counter()
        answer.result, answer.problem = _search_cluster(
            profile,
            hardware,
            size_nodes,
            size_gpus,
            batch,
            _pin_sets(profile, world, methods),
            user_fixed,
            search_kwargs,
        )
        answer.search_s = time.perf_counter() - cluster_started
        frontier.append(answer)
        if not answer.ok:
            continue
        if best is None or answer.key(objective) < best.key(objective):
            best = answer
    frontier.sort(key=lambda a: a.gpus)
    return TimeToTrain(
        limit=limit,
        train_tokens=train_tokens,
        objective=objective,
        frontier=frontier,
        best=best,
        elapsed_s=time.perf_counter() - started,
        gpu_hour_price=gpu_hour_price,
    )
