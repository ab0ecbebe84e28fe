"""The joint search: chunk size, cache blocks, offload share, prefetch, checkpointing and
micro-batch size explored together, each candidate scored by simulated step time.

Loops run from the choices shared by many candidates (chunk size, checkpointing) to the ones
that change only the timeline (offload share), so the cost model's caches are hit. Pruning:

* the smallest offload share that fits is the fewest offloaded chunks whose freed device bytes,
  largest first, cover the need (``costmodel/offload.py`` ``freed_bytes``: a trainable shard frees
  its master, gradient and Adam moments, a frozen one its weights only, an expert chunk's E data
  shards' worth; the offload order may take others first, so each share is checked too); smaller
  shares are never tried;
* host memory grows with the offload share, so the offload loop stops at the first that
  overflows the host;
* a lower bound on the step (compute of all micro-batches, the least the collectives beside it take
  from it, then the optimizer) is checked
  against the K-th best step so far before any simulation;
* along the offload grid, simulation stops after two shares in a row that are slower.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass, field

from elixir_tune.costmodel.layout import ChunkLayout, largest_param_numel, least_padded_sizes
from elixir_tune.costmodel.memory import MemoryEstimate
from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.costmodel.offload import freed_bytes
from elixir_tune.costmodel.parallel import Layout
from elixir_tune.costmodel.timeline import TransferCosts
from elixir_tune.plan.capabilities import expert_parallel_conflicts, selective_conflicts
from elixir_tune.plan.memory import ALIGN_ELEMENTS, chunk_size_multiple
from elixir_tune.plan.stages import schedule_problem
from elixir_tune.search.candidate import Candidate, score
from elixir_tune.search.context_layouts import layered_refused
from elixir_tune.search.space import (
    ALL,
    CHECKPOINTING_CHOICES,
    OFFLOAD_GRID,
    PREFETCH_CHOICES,
    cache_grid,
    chunk_size_grid,
    divisors,
    even_split_sizes,
)
from elixir_tune.search.stages import StageScorer

# Chunk sizes with the least padding the search adds to its 1.5x grid.
LOW_PADDING_SIZES = 3


@dataclass
class Budget:
    """What one rank and one node may use.

    Attributes:
        usable_gpu_bytes: device memory a rank may fill.
        host_bytes: host memory of a node.
        global_batch_size: samples per step over all ranks.
    """

    usable_gpu_bytes: int
    host_bytes: int
    global_batch_size: int


@dataclass
class Exploration:
    """What a search found.

    Attributes:
        best: the best candidates, fastest first.
        num_scored: candidates whose step was simulated.
        min_gpu_bytes: the least device memory any configuration needs (everything offloaded, or at
            the pinned offload share the chunks that free the most; each chunk frees what it holds:
            ``offload.freed_bytes``; None when the pinned choices allow no configuration at all).
        min_host_bytes: the least host memory a configuration that fits the device needs
            (None when none fits the device; on a CPU device, device and host parts together).
        best_by_layout: the fastest candidate scored of each parallel layout (to say why one won).
    """

    best: list[Candidate]
    num_scored: int
    min_gpu_bytes: int | None
    min_host_bytes: int | None
    best_by_layout: dict[Layout, Candidate] = field(default_factory=dict)


def _covers(a: tuple, b: tuple) -> bool:
    """Negated ``Candidate.rank_key``s: ``a`` is as good as ``b`` or better in step time, schedule
    preference, device and host bytes (the offload count only breaks ties)."""
    return a[0] >= b[0] and a[1] >= b[1] and a[3] >= b[3] and a[4] >= b[4]


class _TopK:
    """The K fastest candidates seen so far, leaving out any that another kept one dominates (as
    fast or faster with no more device and host memory), so that the table shows real choices.
    Ranked by ``Candidate.rank_key``: candidates of the same step are ordered by schedule, then by less
    offload, then by less memory.

    With ``one_memory`` (the device is the CPU) device and host memory are the same RAM, so a
    candidate is judged by their sum: offloading there frees nothing and only adds staging copies.
    """

    def __init__(self, k: int, one_memory: bool = False, gpus_per_node: int = 1):
        self.k = max(k, 1)
        self.one_memory = one_memory
        self.gpus_per_node = gpus_per_node
        self._heap: list[tuple] = []
        self._count = 0

    @property
    def threshold_s(self) -> float:
        return -self._heap[0][0] if len(self._heap) >= self.k else math.inf

    @property
    def threshold_key(self) -> tuple[float]:
        """(step,) of the K-th kept candidate: a candidate at or above it cannot enter."""
        return (-self._heap[0][0],) if len(self._heap) >= self.k else (math.inf,)

    def add(self, candidate: Candidate) -> None:
        self._count += 1
        gpu_bytes, host_bytes = candidate.memory.peak_gpu_bytes, candidate.memory.peak_host_bytes
        if self.one_memory:
            gpu_bytes = host_bytes = gpu_bytes * self.gpus_per_node + host_bytes
        key = tuple(-value for value in candidate.rank_key(gpu_bytes, host_bytes))
        item = (*key, -self._count, candidate)
        if any(_covers(kept[:5], key) for kept in self._heap):
            return
        if len(self._heap) >= self.k and item[:6] <= self._heap[0][:6]:
            return
        survivors = [kept for kept in self._heap if not _covers(key, kept[:5])]
        if len(survivors) != len(self._heap):
            self._heap = survivors
            heapq.heapify(self._heap)
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, item)
        else:
            heapq.heapreplace(self._heap, item)

    def ranked(self) -> list[Candidate]:
        return [item[-1] for item in sorted(self._heap, key=lambda item: item[:6], reverse=True)]


def chunk_sizes(model: CostModel, fixed: dict) -> list[int]:
    """Chunk sizes to explore (or the pinned one, checked)."""
    profile = model.profile
    world = model.data_size
    largest = largest_param_numel(profile)  # frozen parameters are chunked too (frozen chunks)
    if "chunk_size" in fixed:
        size = fixed["chunk_size"]
        multiple = chunk_size_multiple(world)
        if size % multiple:
            raise ValueError(
                f"--fix chunk_size={size}: not a multiple of {multiple} ({ALIGN_ELEMENTS} x the data-parallel size "
                f"{world}, so that every shard starts aligned); use {-(-size // multiple) * multiple}"
            )
        if size < largest:
            raise ValueError(f"--fix chunk_size={size}: smaller than the largest parameter ({largest} elements)")
        return [size]
    chunked = sum(p.numel for p in profile.params if not p.shared)
    grid = chunk_size_grid(largest, max(chunked, largest), world)
    # The grid steps by 1.5x; a few sizes that pack the model with the least padding are added.
    candidates = even_split_sizes(largest, max(chunked, largest), world)
    return sorted(set(grid) | set(least_padded_sizes(profile, candidates, LOW_PADDING_SIZES)))


def checkpointing_choices(model: CostModel, fixed: dict) -> list[int]:
    """Checkpointing options (or the pinned one, checked). Under a pipeline only none or all: the
    plan's every-k rule counts global block indices, which a modular stage holds one in P of."""
    num_blocks = len(model.profile.blocks)
    if "checkpointing" in fixed:
        every = fixed["checkpointing"]
        if every and not num_blocks:
            raise ValueError("--fix checkpointing: the model has no repeated blocks to checkpoint")
        return [every]
    choices = CHECKPOINTING_CHOICES if model.parallel_layout.pipeline == 1 else (0, 1)
    return [every for every in choices if every <= num_blocks] if num_blocks else [0]


# Why a profile cannot price selective checkpointing.
SELECTIVE_MISSING = (
    "the profile has no selective-checkpointing figures (made before they were traced, or the analytic "
    "GPT-2 profile); profile the model again with `elixir-tune profile`"
)


def checkpoint_choices(model: CostModel, fixed: dict) -> list[tuple[int, bool]]:
    """(every, selective) pairs: ``checkpointing_choices`` checkpointed fully, and every block
    selectively (torchtitan's op-level policy checkpoints every block) where it can run: beside data
    parallelism only (``capabilities.selective_conflicts``), with the profile's selective figures.
    ``--fix checkpoint_mode`` pins the mode (selective then gives no candidate under other layouts);
    ``--fix checkpointing`` alone pins full checkpointing.

    Raises:
        ValueError: selective pinned with a profile that has no selective figures, or with no
            checkpointed block.
    """
    everies = checkpointing_choices(model, fixed)
    mode = fixed.get("checkpoint_mode")
    layout = model.parallel_layout
    runs = not selective_conflicts(layout.pipeline, layout.tensor, layout.context, layout.expert, "standard")
    if mode == "selective":
        if everies == [0]:
            raise ValueError("--fix checkpoint_mode=selective: no block is checkpointed; pin checkpointing=selective")
        if runs and model.profile.selective is None:
            raise ValueError(f"--fix checkpoint_mode=selective: {SELECTIVE_MISSING}")
        return [(every, True) for every in everies if every > 0] if runs else []
    pairs = [(every, False) for every in everies]
    # A pinned checkpointing without a mode is the full one, as before selective existed.
    offered = runs and model.profile.selective is not None and mode is None and "checkpointing" not in fixed
    offered = offered and 1 in everies
    return pairs + [(1, True)] if offered else pairs


def micro_batch_choices(per_rank_batch: int, fixed: dict) -> list[int]:
    """Micro-batch sizes, largest first (or the pinned one, checked)."""
    if "micro_batch_size" in fixed:
        size = fixed["micro_batch_size"]
        if per_rank_batch % size:
            raise ValueError(
                f"--fix micro_batch_size={size}: does not divide the {per_rank_batch} samples per rank "
                "(global batch / world size)"
            )
        return [size]
    return divisors(per_rank_batch)[::-1]


def micro_batch_accumulation_choices(per_rank_batch: int, fixed: dict, pipeline: int = 1) -> list[tuple[int, bool]]:
    """(micro-batch size, layered) pairs: layered accumulation is tried wherever a step has more than
    one micro-batch (with one it is the same as standard); ``--fix accumulation`` pins it. A
    pipeline plan with several micro-batches is always layered: its schedule orders them (the
    engine's pipeline step runs no layered threads), and the cost model prices its copies by the
    schedule (``CostModel.activation_copies``)."""
    pinned = fixed.get("accumulation")
    pairs = []
    for micro_batch in micro_batch_choices(per_rank_batch, fixed):
        several = per_rank_batch // micro_batch > 1
        for layered in (False, True):
            if pinned is not None and layered != (pinned == "layered"):
                continue
            if layered and not several:
                continue
            if pipeline > 1 and several and not layered:
                continue
            pairs.append((micro_batch, layered))
    if not pairs and pipeline == 1:
        raise ValueError(
            f"--fix accumulation=layered: a per-rank batch of {per_rank_batch} leaves one micro-batch per step "
            "with the pinned micro-batch size; layered accumulation needs several (raise the global batch or "
            "lower --fix micro_batch_size)"
        )
    return pairs


def cache_choices(minimum: int, cacheable: int, fixed: dict) -> list[int]:
    """Cache sizes to try for one chunk size and checkpointing."""
    if cacheable == 0:
        return [0]
    pinned = fixed.get("cache_blocks")
    if pinned == ALL:
        return [cacheable]
    if pinned is not None:
        size = min(pinned, cacheable)
        return [size] if size >= minimum else []
    return cache_grid(minimum, cacheable)


def prefetch_choices(cache_blocks: int, minimum: int, cacheable: int, fixed: dict) -> list[int]:
    """Prefetch depths that a cache of ``cache_blocks`` leaves room for."""
    room = cache_blocks - minimum if cache_blocks < cacheable else cache_blocks - 1
    if "prefetch" in fixed:
        depth = fixed["prefetch"]
        return [depth] if depth == 0 or depth <= room else []
    return sorted({max(0, min(depth, room)) for depth in PREFETCH_CHOICES})


def offload_choices(num_chunks: int, smallest: int, fixed: dict, one_pool: bool = False) -> list[int]:
    """Offloaded chunk counts: the smallest that fits, then a grid of shares above it.

    On a CPU device (``one_pool``) offloading frees no memory and saves no time (the host is the
    device), so only no offload is explored unless a share is pinned.
    """
    if "offload" in fixed:
        count = int(fixed["offload"] * num_chunks + 0.5)  # half up: 0.5 of 5 chunks is 3
        return [count] if count >= smallest else []
    if one_pool:
        return [0] if smallest == 0 else []
    grid = {round(i * num_chunks / OFFLOAD_GRID) for i in range(OFFLOAD_GRID + 1)}
    return sorted({smallest} | {count for count in grid if count >= smallest})


def _one_pool_bytes(memory: MemoryEstimate, model: CostModel) -> int:
    """On a CPU device, what a node's RAM holds: every rank's device part (with its margin) and the
    host part (offloaded shards and their buffers)."""
    return memory.required_gpu_bytes * model.gpus_per_node + memory.peak_host_bytes


def explore(model: CostModel | list[CostModel], budget: Budget, fixed: dict, top_k: int) -> Exploration:
    """Runs the joint search over one cost model or several (one per parallel layout, data-only first).

    Args:
        model: the cost model (fixes profile, hardware, cluster, dtype and parallel layout), or a
            list of them, whose candidates compete in one ranking.
        budget: memory limits and the global batch.
        fixed: pinned choices (``parse_fixed``).
        top_k: how many of the best candidates to keep.

    Returns:
        The best candidates and what the search learnt about memory.
    """
    models = model if isinstance(model, list) else [model]
    first = models[0]
    top = _TopK(top_k, one_memory=first.hardware.device == "cpu", gpus_per_node=first.gpus_per_node)
    found = Exploration(best=[], num_scored=0, min_gpu_bytes=None, min_host_bytes=None)
    refusals: list[ValueError] = []
    for each in models:
        try:
            _explore_layout(each, budget, fixed, top, found)
        except ValueError as error:
            # Another layout may take the pins (e.g. layered needs several micro-batches per data rank).
            refusals.append(error)
    if len(refusals) == len(models):
        raise refusals[0]  # a pin no layout can take: say why (the data-parallel layout's reason)
    found.best = top.ranked()
    return found


@dataclass
class _LayoutRun:
    """What one parallel layout's exploration reads throughout (its cost model, limits and results)."""

    model: CostModel
    budget: Budget
    fixed: dict
    top: _TopK
    found: Exploration
    per_rank: int  # samples per data index and step
    one_pool: bool  # a CPU device: the host is the device
    scorer: StageScorer


@dataclass
class _Sized:
    """What one chunk size fixes: its layout, the chunks that may go to the host and what they free."""

    chunk_size: int
    layout: ChunkLayout
    offloadable: int
    shard_numel: int
    most_freed: list[int]  # [k]: the most device bytes k offloaded chunks free
    costs: TransferCosts
    most_offloaded: int  # the largest offload count the pins allow
    # The collectives' least cost to compute (``collective_loss_floor``): per step, per reduced micro-batch.
    loss_floor_s: tuple[float, float] = (0.0, 0.0)


def _explore_layout(model: CostModel, budget: Budget, fixed: dict, top: _TopK, found: Exploration) -> None:
    """The joint search's loops for one cost model (one parallel layout), into ``top`` and ``found``.

    Per chunk size, checkpointing, micro-batch, cache size and prefetch depth: the smallest offload
    share that fits (``_fit``), then the shares above it in each offload order (``_explore_order``).
    """
    per_rank = budget.global_batch_size // (model.data_size // model.parallel_layout.context)  # per data index
    run = _LayoutRun(model, budget, fixed, top, found, per_rank, model.hardware.device == "cpu", StageScorer(model))
    for chunk_size in chunk_sizes(model, fixed):
        sized = _sized(run, chunk_size)
        for every, selective in checkpoint_choices(model, fixed):
            minimum = model.min_cache_blocks(chunk_size, every)
            for micro_batch, layered in _runnable_micro_batches(run, selective):
                accum = per_rank // micro_batch
                # A lower bound of the step: the compute and the context exchange, stretched by the pipeline bubble,
                # and the least the collectives beside the compute take from it.
                on_stream_s = model.compute_s(micro_batch, every, selective)[0] + sum(
                    model.context_s(micro_batch, every)
                )
                compute_s = accum * on_stream_s * model.parallel_costs.pipeline_factor(accum)
                if model.parallel_layout.pipeline == 1:  # a stage's bubble may hide its losses: none added there
                    per_step_s, per_reduction_s = sized.loss_floor_s
                    compute_s += per_step_s + (1 if layered else accum) * per_reduction_s
                if compute_s >= top.threshold_s:
                    # K candidates fit already (the memory figures below only serve the error when none does).
                    continue
                for cache_blocks in cache_choices(minimum, sized.layout.num_cacheable, fixed):
                    for prefetch in prefetch_choices(cache_blocks, minimum, sized.layout.num_cacheable, fixed):
                        base = Shape(
                            chunk_size,
                            cache_blocks,
                            0,
                            prefetch,
                            every,
                            micro_batch,
                            accum,
                            layered=layered,
                            selective=selective,
                        )
                        fit = _fit(run, sized, base)
                        if fit is None or compute_s >= top.threshold_s:
                            continue
                        # One order of the chunks to offload, two with frozen chunks (a LoRA base): the cheapest per
                        # device byte freed first, and the cheapest per chunk first (costmodel/offload.py).
                        for order_index, order in enumerate(model.offload_orders(chunk_size, every, cache_blocks)):
                            _explore_order(run, sized, base, fit, compute_s, order if order_index else None)


def _sized(run: _LayoutRun, chunk_size: int) -> _Sized:
    model = run.model
    layout = model.layout(chunk_size)
    shard_numel = chunk_size // model.data_size
    # most_freed[k]: the most device bytes k offloaded chunks free (those that free the most: a frozen
    # chunk frees its weights only, an expert chunk E data shards' worth, the others one shard's state).
    freed = freed_bytes(layout, shard_numel, model.dtype, model.experts.shard_weights(layout))
    most_freed = list(itertools.accumulate(sorted((freed[c] for c in model.experts.movable(layout)), reverse=True)))
    most_freed.insert(0, 0)
    offloadable = model.offloadable_chunks(chunk_size)  # expert chunks stay where the engine cannot offload them
    most_offloaded = max(offload_choices(offloadable, 0, run.fixed, run.one_pool))
    costs = model.costs(chunk_size)
    floor = collective_loss_floor(layout, costs) if model.parallel_layout.expert == 1 else (0.0, 0.0)
    return _Sized(chunk_size, layout, offloadable, shard_numel, most_freed, costs, most_offloaded, floor)


def collective_loss_floor(layout: ChunkLayout, costs: TransferCosts) -> tuple[float, float]:
    """The least compute the collectives beside it take (``TransferCosts.compute_loss``): every chunk
    not resident is gathered at least once a step, every trainable one reduce-scattered once per
    reduction (each micro-batch; once a step when accumulation is layered). A charged loss is never
    absorbed (a wait for a fetch only shrinks), so these add to the step's lower bound."""
    if costs.compute_loss <= 0:
        return 0.0, 0.0
    gathered = sum(1 for chunk in layout.chunks if not (chunk.resident or chunk.expert))
    reduced = sum(1 for chunk in layout.chunks if not (chunk.resident or chunk.expert or chunk.frozen))
    return costs.compute_loss * gathered * costs.allgather_s, costs.compute_loss * reduced * costs.reduce_scatter_s


def _runnable_micro_batches(run: _LayoutRun, selective: bool) -> list[tuple[int, bool]]:
    """(micro-batch size, layered) pairs the layout can run (with selective checkpointing or not)."""
    model, stages = run.model, run.model.parallel_layout.pipeline
    tensor = model.parallel_layout
    grid_rows = math.isqrt(tensor.tensor) if tensor.tensor_mode == "2d" else 1
    num_blocks = len(model.full_profile.blocks)
    no_layered = layered_refused(model.full_profile, tensor)
    out = []
    for micro_batch, layered in micro_batch_accumulation_choices(run.per_rank, run.fixed, stages):
        if layered and (selective or no_layered):
            continue  # selective checkpointing and context parallelism run standard accumulation (capabilities)
        if micro_batch % grid_rows:
            continue  # 2D tensor parallelism splits each micro-batch over the q rows of its grid
        if schedule_problem(num_blocks, stages, tensor.assignment, tensor.schedule, run.per_rank // micro_batch):
            continue  # e.g. 1F1B with fewer micro-batches than stages (plan/stages.py)
        if tensor.expert > 1 and expert_parallel_conflicts(stages, tensor.tensor, "layered" if layered else "standard"):
            continue  # the engine does not run this beside expert parallelism (plan/capabilities.py)
        out.append((micro_batch, layered))
    return out


def _fit(run: _LayoutRun, sized: _Sized, base: Shape) -> tuple[int, MemoryEstimate] | None:
    """The fewest offloaded chunks with which ``base`` fits the device, and that shape's estimate.

    Closed form: the fewest chunks whose freed bytes cover the need. Records the least device and
    host memory seen (for the error when nothing fits). None: no share fits.
    """
    model, found, budget = run.model, run.found, run.budget
    memory = model.memory(base)
    # The least device memory of this shape: every shard it may offload on the host
    # (on a CPU device an offloaded shard stays in the same memory).
    need_least = memory.required_gpu_bytes - (0 if run.one_pool else sized.most_freed[sized.most_offloaded])
    if found.min_gpu_bytes is None or need_least < found.min_gpu_bytes:
        found.min_gpu_bytes = need_least
    over = memory.required_gpu_bytes - budget.usable_gpu_bytes  # the margin stays free
    smallest = bisect.bisect_left(sized.most_freed, over)  # offloadable + 1: none covers it
    if run.one_pool:
        if over > 0:
            return None  # offloading would not make it fit: the host is the device
        smallest = 0
    if smallest > sized.offloadable or smallest > sized.most_offloaded:
        return None  # does not fit the device (at the pinned offload share)
    if smallest:  # the same shape as ``base`` when nothing need be offloaded: its estimate is ``base``'s
        memory = model.memory(_with_offload(base, smallest, None))
    host_need = _one_pool_bytes(memory, model) if run.one_pool else memory.peak_host_bytes
    if found.min_host_bytes is None or host_need < found.min_host_bytes:
        found.min_host_bytes = host_need
    return smallest, memory


def _with_offload(base: Shape, count: int, order: list[int] | None) -> Shape:
    """``base`` with ``count`` chunks offloaded: the model's first ones, or the first ``count`` of ``order``."""
    return Shape(
        base.chunk_size,
        base.cache_blocks,
        count,
        base.prefetch,
        base.every,
        base.micro_batch_size,
        base.grad_accum_steps,
        offloaded=None if order is None else tuple(order[:count]),
        layered=base.layered,
        selective=base.selective,
    )


def _explore_order(
    run: _LayoutRun,
    sized: _Sized,
    base: Shape,
    fit: tuple[int, MemoryEstimate],
    compute_s: float,
    order: list[int] | None,
) -> None:
    """Scores the offload shares from the smallest that fits upwards, in one offload order (None: the
    model's first), until the host is full or the step grew twice in a row."""
    model, budget, found = run.model, run.budget, run.found
    smallest, fitting = fit
    previous, worse = (math.inf,), 0
    for offloaded in offload_choices(sized.offloadable, smallest, run.fixed, run.one_pool):
        shape = _with_offload(base, offloaded, order)
        if compute_s + sized.costs.grad_norm_s + _optimizer_bound_s(run, sized, shape) >= run.top.threshold_s:
            continue  # the optimizer bound is V-shaped in the offload share
        # The first order's smallest share is the ``fitting`` shape: its estimate is known.
        memory = fitting if order is None and offloaded == smallest else model.memory(shape)
        if memory.peak_host_bytes > budget.host_bytes:
            break
        if memory.required_gpu_bytes > budget.usable_gpu_bytes:
            continue  # offloaded frozen shards free less than ``smallest`` assumed
        if run.one_pool and _one_pool_bytes(memory, model) > budget.host_bytes:
            break  # a CPU device: its memory is the host's
        candidate = _scored(run, shape, memory)
        if candidate is None:
            continue
        run.top.add(candidate)
        kept = found.best_by_layout.get(model.parallel_layout)
        if kept is None or candidate.rank_key() < kept.rank_key():
            found.best_by_layout[model.parallel_layout] = candidate
        worse = worse + 1 if candidate.rank_key()[:1] > previous else 0
        if worse >= 2:
            break
        previous = candidate.rank_key()[:1]


def _optimizer_bound_s(run: _LayoutRun, sized: _Sized, shape: Shape) -> float:
    """The optimizer step's time: Adam on the device and on the host run side by side."""
    # Adam steps trainable shards only: offloaded frozen ones (a LoRA base) have none.
    on_host = run.model.offloaded_shards(shape)[0]
    on_device = sized.layout.num_chunks - sized.layout.num_frozen - on_host
    return max(
        on_device * sized.shard_numel / run.model.hardware.gpu_adam_elems_per_s,
        on_host * sized.shard_numel / run.model.cpu_adam_elems_per_s,
    )


def _scored(run: _LayoutRun, shape: Shape, memory: MemoryEstimate) -> Candidate | None:
    """The candidate of ``shape``; under a pipeline the whole pipeline's, None when it cannot win or
    another stage does not fit."""
    model, budget = run.model, run.budget
    candidate = score(model, shape, memory, budget.global_batch_size)
    run.found.num_scored += 1
    if model.parallel_layout.pipeline == 1:
        return candidate
    kept = run.found.best_by_layout.get(model.parallel_layout)
    if candidate.rank_key()[:1] >= min(run.top.threshold_key, kept.rank_key()[:1] if kept else (math.inf,)):
        return None  # the critical stage's step is a lower bound of the pipeline's
    whole = run.scorer.whole(candidate, budget.global_batch_size, budget.usable_gpu_bytes, budget.host_bytes)
    if whole is None or run.one_pool and _one_pool_bytes(whole.memory, model) > budget.host_bytes:
        return None  # another stage does not fit
    return whole
