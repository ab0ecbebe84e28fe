"""The cost model of one model on one cluster: memory and step time of any candidate plan shape.

Everything that several candidates share is computed once and kept: the chunk layout per chunk
size, the chunk trace per (chunk size, checkpointing), the cache simulation per (chunk size,
checkpointing, cache blocks) and the transfer costs per chunk size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from elixir_tune.costmodel.cache import CacheSim, simulate_cache
from elixir_tune.costmodel.compute import ComputeTimes
from elixir_tune.costmodel.context import ContextWidths, context_share
from elixir_tune.costmodel.expert import RankExperts
from elixir_tune.costmodel.layout import ChunkLayout, largest_trainable_numel, max_module_chunks, pack_chunks
from elixir_tune.costmodel.links import data_ranks_per_node
from elixir_tune.costmodel.memory import MemoryEstimate, estimate_memory
from elixir_tune.costmodel.offload import offload_orders
from elixir_tune.costmodel.parallel import DATA_ONLY, Layout, held_activation_copies
from elixir_tune.costmodel.parallel_time import ParallelTimes
from elixir_tune.costmodel.rates import (
    attention_flops_share,
    attention_scores_bytes,
    plausibility_bound,
    pointwise_beyond_rate,
)
from elixir_tune.costmodel.shape import Shape, StepEstimate
from elixir_tune.costmodel.stage_profile import critical_stage, rank_profile
from elixir_tune.costmodel.timeline import (
    LEFTOVER_ZERO,
    MicroBatchTime,
    TransferCosts,
    combine_step,
    issue_groups,
    issue_steps,
    micro_batches,
    simulate_micro_batch,
    step_blocks,
    transfer_costs,
)
from elixir_tune.costmodel.trace import ChunkTrace, checkpointed_trace, chunk_trace
from elixir_tune.hardware.spec import HardwareSpec
from elixir_tune.profiler.schema import ModelProfile


class CostModel(ComputeTimes):
    """Memory and time of candidates for one (profile, cluster, dtype, parallel layout).

    With pipeline or tensor parallelism (``layout``) the model is one rank's: ``profile`` is what a
    rank of one pipeline stage holds and runs at its tensor-parallel local shapes
    (``stage_profile.rank_profile``; by default the critical stage, the one holding the most), chunks are
    sharded over the data-parallel degree ``data_size`` = world / (P x T), and ``step_time`` adds
    the tensor-parallel collectives, the pipeline bubble, point-to-point sends and the
    tied-embedding all-reduce (``parallel_time.ParallelTimes``). ``full_profile`` is the whole model.

    With expert parallelism (``layout.expert`` E > 1, ``costmodel/expert.py``) the rank holds 1/E of
    each expert tensor in expert chunks, sharded over the D / E ranks of its expert-data group (a
    shard E times another chunk's; collectives over D / E ranks: ``expert_costs``), never offloaded
    where the engine cannot (``capabilities.EXPERT_PARALLEL_RUNS_WITH``), and each micro-batch adds
    the all-to-alls of its MoE blocks to the compute (``expert_comm_s``).
    """

    def __init__(
        self,
        profile: ModelProfile,
        hardware: HardwareSpec,
        gpus_per_node: int,
        nodes: int = 1,
        dtype: str | None = None,
        layout: Layout = DATA_ONLY,
        stage: int | None = None,
    ):
        """Prepares the model.

        Args:
            profile: the model profile.
            hardware: the node spec.
            gpus_per_node: ranks per node.
            nodes: nodes.
            dtype: compute dtype (default: the profile's).
            layout: pipeline and tensor parallelism (default: data parallelism only).
            stage: the pipeline stage to model (default: ``stage_profile.critical_stage``).

        Raises:
            ValueError: the layout does not divide the world.
        """
        self.full_profile = profile
        self.parallel_layout = layout
        self.hardware = hardware
        self.gpus_per_node = gpus_per_node
        self.nodes = nodes
        self.world_size = gpus_per_node * nodes
        self.data_size = layout.data_degree(self.world_size)
        self.stage = critical_stage(profile, layout) if stage is None else stage
        self.dtype = dtype or profile.dtype
        # Under context parallelism the rank computes 1/C of every sample (costmodel/context.py).
        # (Its activation lines stay at the profile's dtype: ``memory.activation_bytes`` rescales them.)
        self.profile = context_share(
            rank_profile(profile, layout, self.stage), layout.context, layout.context_mode, tensor=layout.tensor
        )
        self.context_widths = ContextWidths.of(profile, layout.context, layout.context_mode, self.dtype, layout.tensor)
        self._context_s: dict[tuple[int, int], tuple[float, float]] = {}
        # Read by every memory estimate: the largest gradient in flight (a 1d embedding's arrives whole).
        self.largest_numel = max(largest_trainable_numel(self.profile), getattr(self.profile, "whole_grad_numel", 0))
        # The model-level rate (block curve or model_tflops), not the bare matmul rate: a whole
        # model's forward+backward runs well below its GEMMs (llm-foundry: A100 MFU 44-56%, H100
        # ~565 TFLOP/s HFU against ~800 TFLOP/s GEMMs; REFERENCE.md 'Published figures').
        hardware.compute_tflops(self.dtype)  # fails early when the spec has no rate for the dtype
        self._rates: dict[int, float] = {}
        self._per_micro_batch: dict[tuple[int, int, bool], tuple[tuple[float, float], float, float]] = {}
        # The attention products' own rate (0: they run at the block rate with the rest); their
        # share of the FLOPs is the whole model's, which a stage or a tensor shard keeps.
        self.attention_flops_per_s = hardware.attention_tflops.get(self.dtype, 0.0) * 1e12
        self.attention_share = attention_flops_share(profile) if self.attention_flops_per_s else 0.0
        # A traced model's pointwise bytes beyond those the rate already includes are priced at the
        # pointwise rate (``pointwise_s``): the share of them that is beyond.
        self.pointwise_share = pointwise_beyond_rate(profile, hardware, self.dtype)
        # An eager attention's scores through HBM, per FLOP of the model (a stage or a tensor shard
        # moves its FLOPs' share); beside a fused kernel's attention rate or a flat rate taken from
        # fused-attention runs, which leave them out.
        priced = self.attention_flops_per_s > 0 or hardware.rate_fused_attention
        scores = (
            attention_scores_bytes(profile, self.dtype, dropout_counted=self.pointwise_share > 0)
            if priced
            else (0.0, 0.0)
        )
        hbm_bytes_per_s = hardware.hbm_gbps * 1e9
        self.scores_s_per_flop = (
            tuple(bytes_ / hbm_bytes_per_s / profile.flops_per_sample for bytes_ in scores)
            if profile.flops_per_sample
            else (0.0, 0.0)
        )
        # On a CPU device an attention with dropout runs the math path: its score elements' extra time
        # per sample (``HardwareSpec.dropout_attention_s_per_score``; the block rate is flash's).
        self.dropout_attention_s_per_sample = (
            sum(b.dropout_scores_per_sample for b in self.profile.blocks) * hardware.dropout_attention_s_per_score
            if hardware.device == "cpu"
            else 0.0
        )
        # Host Adam with every rank of the node stepping at once (min of process and node rates).
        self.cpu_adam_elems_per_s = hardware.cpu_adam_rate_per_rank(gpus_per_node)
        # PCIe-only GPUs: collectives and host copies share each GPU's link (world 1 has no collectives).
        self.shared_link = hardware.shared_host_link and self.world_size > 1 and hardware.device != "cpu"
        self.parallel_costs = ParallelTimes(profile, hardware, gpus_per_node, layout, self.stage, self.dtype)
        self.experts = RankExperts.of(profile, self.profile, layout.expert, self.data_size)
        self._module_chunks: dict[int, int] = {}
        self._layouts: dict[int, ChunkLayout] = {}
        self._traces: dict[tuple[int, int, int], tuple[ChunkTrace, list[tuple[int, ...]]]] = {}
        # (checkpointing, micro-batches) -> the module-level trace, the same for every chunk size
        self._module_traces: dict[tuple[int, int], list[tuple[list[int], int]]] = {}
        self._sims: dict[tuple[int, int, int, int], tuple[CacheSim, list[tuple[int, int, int]]]] = {}
        self._costs: dict[int, TransferCosts] = {}
        self._orders: dict[tuple[int, int, int], list[list[int]]] = {}
        self._issues: dict[tuple[int, int, int, int, int, bool], tuple[list[int], list[list[tuple[int, int]]]]] = {}

    # -- shared pieces ---------------------------------------------------------------------------

    def share_chunk_caches(self, other: CostModel) -> None:
        """Reads and fills ``other``'s caches of chunk layouts, traces, cache simulations, transfer
        costs, offload orders and fetch issues from now on: valid where the two differ only in their
        context degree or mode (the same rank parameters, module trace and block structure, every
        per-sample figure divided alike, the same data degree and links), so the search packs and
        simulates each chunk size once for a layout and its context variants.

        Raises:
            ValueError: the two models' ranks hold different parameters or shard over other groups.
        """
        mine, theirs = self.parallel_layout, other.parallel_layout
        same = replace(mine, context=1, context_mode="ulysses") == replace(theirs, context=1, context_mode="ulysses")
        if not same or self.data_size != other.data_size or self.dtype != other.dtype:
            raise ValueError(f"layouts {mine.describe()} and {theirs.describe()} do not share chunk caches")
        self._module_chunks, self._layouts, self._traces = other._module_chunks, other._layouts, other._traces
        self._module_traces, self._sims, self._costs = other._module_traces, other._sims, other._costs
        self._orders, self._issues = other._orders, other._issues

    def layout(self, chunk_size: int) -> ChunkLayout:
        """The chunk layout of one chunk size (cached)."""
        if chunk_size not in self._layouts:
            self._layouts[chunk_size] = pack_chunks(self.profile, chunk_size, self.experts.params)
        return self._layouts[chunk_size]

    def trace(self, chunk_size: int, every: int) -> ChunkTrace:
        """The chunk trace of one micro-batch (cached)."""
        return self._trace(chunk_size, every)[0]

    def _trace(self, chunk_size: int, every: int, micro_batches: int = 1) -> tuple[ChunkTrace, list[tuple[int, ...]]]:
        """The trace (cached) and, per step, the chunks whose gradients are complete after it.
        ``micro_batches`` > 1: the trace of a layered step (``chunk_trace``)."""
        key = (chunk_size, every, micro_batches)
        if key not in self._traces:
            layout = self.layout(chunk_size)
            module_key = (every, micro_batches)
            if module_key not in self._module_traces:
                self._module_traces[module_key] = checkpointed_trace(self.profile, every, micro_batches)
            trace = chunk_trace(self.profile, layout, every, micro_batches, self._module_traces[module_key])
            reduce_after: list[list[int]] = [[] for _ in trace.steps]
            for chunk, step in enumerate(trace.last_use):
                if step >= 0 and not layout.chunks[chunk].frozen:  # a frozen chunk is never reduced
                    reduce_after[step].append(chunk)
            self._traces[key] = (trace, [tuple(r) for r in reduce_after])
        return self._traces[key]

    def min_cache_blocks(self, chunk_size: int, every: int) -> int:
        """The fewest cache blocks any step can run with (no prefetch): the most chunks one traced
        operation needs, or one module with the modules enclosing it (the engine's own minimum)."""
        layout = self.layout(chunk_size)
        if chunk_size not in self._module_chunks:
            self._module_chunks[chunk_size] = max_module_chunks(self.profile, layout)
        needed = max(self.trace(chunk_size, every).max_step_chunks, self._module_chunks[chunk_size])
        return max(needed, 1 if layout.num_cacheable else 0)

    def cache_sim(
        self, chunk_size: int, every: int, cache_blocks: int, micro_batches: int = 1
    ) -> tuple[CacheSim, list[tuple[int, int, int]]]:
        """Cache simulation (cached) and the cold fetch list with resident chunks added."""
        key = (chunk_size, every, cache_blocks, micro_batches)
        if key not in self._sims:
            layout = self.layout(chunk_size)
            trace = self._trace(chunk_size, every, micro_batches)[0]
            sim = simulate_cache(trace.steps, cache_blocks, layout.num_cacheable)
            resident = [
                (trace.first_use[c], c, -1)
                for c, chunk in enumerate(layout.chunks)
                if chunk.resident and trace.first_use[c] >= 0
            ]
            cold = sorted(sim.cold + resident, key=lambda fetch: fetch[0])
            self._sims[key] = (sim, cold)
        return self._sims[key]

    def costs(self, chunk_size: int) -> TransferCosts:
        """Per-chunk operation times (cached)."""
        if chunk_size not in self._costs:
            ranks = data_ranks_per_node(self.gpus_per_node, self.parallel_layout.model_parallel)
            self._costs[chunk_size] = transfer_costs(
                self.hardware, chunk_size, self.data_size, self.gpus_per_node, self.nodes, self.dtype, ranks
            )
        return self._costs[chunk_size]

    def expert_costs(self, chunk_size: int) -> dict[int, TransferCosts]:
        """Per-chunk operation times of the expert chunks (``RankExperts.chunk_costs``)."""
        layout = self.layout(chunk_size)
        return self.experts.chunk_costs(layout, self.hardware, self.gpus_per_node, self.nodes, self.dtype)

    def offloadable_chunks(self, chunk_size: int) -> int:
        """Chunks whose shard may go to the host (``RankExperts.offloadable``)."""
        return self.experts.offloadable(self.layout(chunk_size))

    def offload_orders(self, chunk_size: int, every: int, cache_blocks: int) -> list[list[int]]:
        """The orders in which chunks' shards go to the host (``costmodel/offload.py``): the cheapest per
        device byte freed first, and with frozen chunks also the cheapest per chunk first. Expert chunks
        are left out where the engine keeps them on the device."""
        key = (chunk_size, every, cache_blocks)
        if key not in self._orders:
            sim, cold = self.cache_sim(chunk_size, every, cache_blocks)
            layout = self.layout(chunk_size)
            counts = [0] * layout.num_chunks
            for _step, chunk, _free in cold + sim.steady:  # two passes: the cold one and a steady one
                counts[chunk] += 1
            adam_s_per_elem = 1 / self.cpu_adam_elems_per_s - 1 / self.hardware.gpu_adam_elems_per_s
            shard_numel = chunk_size // self.data_size
            costs = self.costs(chunk_size)
            weights, expert = self.experts.shard_weights(layout), self.expert_costs(chunk_size)
            orders = offload_orders(layout, counts, 2, shard_numel, self.dtype, costs, adam_s_per_elem, expert, weights)
            movable = set(self.experts.movable(layout))
            self._orders[key] = [[c for c in order if c in movable] for order in orders]
        return self._orders[key]

    def offload_order(self, chunk_size: int, every: int, cache_blocks: int) -> list[int]:
        """The order a shape without explicit chunk ids offloads by: the first of ``offload_orders``."""
        return self.offload_orders(chunk_size, every, cache_blocks)[0]

    def offloaded_shards(self, shape: Shape) -> tuple[int, int]:
        """The shape's offloaded shards, trainable and frozen (no host Adam), counted in data-group
        shards: an expert chunk's shard is E of them (``RankExperts.shards_of``)."""
        layout = self.layout(shape.chunk_size)
        if not shape.num_offloaded or not (layout.num_frozen or self.experts.degree > 1 and layout.num_expert):
            return shape.num_offloaded, 0  # every shard one trainable data shard
        chunks = [c for c, off in enumerate(self.offload_mask(shape)) if off]
        frozen = self.experts.shards_of(layout, [c for c in chunks if layout.chunks[c].frozen])
        return self.experts.shards_of(layout, chunks) - frozen, frozen

    def offload_mask(self, shape: Shape) -> list[bool]:
        """Per chunk, whether its shard is offloaded."""
        mask = [False] * self.layout(shape.chunk_size).num_chunks
        chosen: Sequence[int] | None = shape.offloaded
        if chosen is None:
            chosen = self.offload_order(shape.chunk_size, shape.every, shape.cache_blocks)[: shape.num_offloaded]
        for chunk in chosen:
            mask[chunk] = True
        return mask

    # -- per candidate (compute and its collectives: costmodel/compute.py) -----------------------

    def memory(self, shape: Shape) -> MemoryEstimate:
        """Peak device and host memory of a candidate."""
        layout = self.layout(shape.chunk_size)
        # Counted in data-group shards: an expert chunk's shard is E of them (sharded over D / E ranks).
        trainable_offloaded, frozen_offloaded = self.offloaded_shards(shape)
        expert_offloaded = trainable_offloaded and self.experts.degree > 1 and layout.num_expert
        mask = self.offload_mask(shape) if expert_offloaded else [False] * layout.num_chunks
        return estimate_memory(
            self.profile,
            chunk_size=shape.chunk_size,
            world_size=self.data_size,
            gpus_per_node=self.gpus_per_node,
            dtype=self.dtype,
            cache_blocks=shape.cache_blocks,
            num_resident=layout.num_resident,
            num_chunks=self.experts.shard_units(layout),
            num_offloaded=trainable_offloaded + frozen_offloaded,
            frozen_numel=0,  # every frozen parameter is in a frozen chunk
            num_frozen=self.experts.shards_of(layout, [c for c, chunk in enumerate(layout.chunks) if chunk.frozen])
            if layout.num_frozen
            else 0,
            num_frozen_offloaded=frozen_offloaded,
            own_landing_numels=self.experts.landing_numels(layout, mask, shape.chunk_size // self.data_size),
            micro_batch_size=shape.micro_batch_size,
            every=shape.every,
            selective=shape.selective,
            activation_copies=self.activation_copies(shape),
            micro_batches=shape.grad_accum_steps,
            allocator_overhead_bytes=self.hardware.allocator_overhead_bytes,
            prefetch=shape.prefetch,
            staging_buffers=shape.staging_buffers,
            device=self.hardware.device,
            device_memory_bytes=self.hardware.gpu_memory_bytes,
            largest_param_numel=self.largest_numel,
            communicators=self.parallel_costs.communicators(self.data_size),
            whole_model_line=self.profile is self.full_profile,
        )

    def activation_copies(self, shape: Shape) -> int:
        """Micro-batches whose activations this rank holds at once: on a pipeline stage what its
        schedule holds (``parallel.held_activation_copies``: every micro-batch breadth-first, at most
        P - s under 1F1B; the engine's pipeline runs its schedule whatever the plan's accumulation),
        otherwise all of a layered step's, one of a standard step's."""
        layout, accum = self.parallel_layout, shape.grad_accum_steps
        if layout.pipeline > 1:
            return held_activation_copies(layout.schedule, layout.pipeline, self.stage, accum)
        return accum if shape.layered else 1

    def step_time(self, shape: Shape, record: list[tuple[str, float, float, str, int]] | None = None) -> StepEstimate:
        """Simulated step time of a candidate.

        Args:
            shape: the candidate.
            record: when given, every block of work of the step is appended to it
                (``timeline.step_blocks``), for a picture of the step.

        Returns:
            The step time and its breakdown.
        """
        # What each distinct simulated micro-batch recorded (for a picture of the step).
        records: list[list[tuple[str, float, float, int]]] = []
        # Layered with recomputation: each block recomputes once per micro-batch (engine/layered.py).
        traced = shape.grad_accum_steps if shape.layered and shape.every > 0 else 1
        trace, reduce_after = self._trace(shape.chunk_size, shape.every, traced)
        sim, cold = self.cache_sim(shape.chunk_size, shape.every, shape.cache_blocks, traced)
        offloaded = self.offload_mask(shape)
        costs = self.costs(shape.chunk_size)
        expert_costs = self.expert_costs(shape.chunk_size)
        mb_compute, mb_recompute = self.compute_s(shape.micro_batch_size, shape.every, shape.selective)
        accum = shape.grad_accum_steps
        # Layered: each trace step runs for all micro-batches at once, with one micro-batch's fetches
        # and reductions (those of the first after the optimizer step: the cold simulation).
        passes = shape.passes_per_step
        pass_compute = mb_compute * accum / passes
        step_compute = [share * pass_compute for share in trace.flops_share]
        on_cpu = self.hardware.device == "cpu"

        def simulate(
            fetches: list[tuple[int, int, int]], busy_s: tuple[float, float, float, float] = LEFTOVER_ZERO
        ) -> MicroBatchTime:
            blocks: list[tuple[str, float, float, int]] | None = None
            if record is not None:
                blocks = []
                records.append(blocks)
            issue, issued_at = self._issue_steps(shape, traced, fetches is sim.steady, fetches, len(step_compute))
            return simulate_micro_batch(
                step_compute,
                fetches,
                issue,
                reduce_after,
                offloaded,
                costs,
                chunk_costs=expert_costs,
                shared_compute=on_cpu,
                shared_link=self.shared_link,
                record=blocks,
                busy_s=busy_s,
                issued_at=issued_at,
            )

        # Later micro-batches start from the steady cache, and with what the one before left busy.
        parts = micro_batches(simulate(cold), passes, lambda busy: simulate(sim.steady, busy))
        shard_numel = shape.chunk_size // self.data_size
        # The optimizer steps the trainable shards only (a frozen chunk has nothing to update).
        frozen = [chunk.frozen for chunk in self.layout(shape.chunk_size).chunks]
        # An expert chunk's shard is E times another's (sharded over D / E ranks).
        weight = [self.experts.degree if c in expert_costs else 1 for c in range(len(frozen))]
        host_shards = sum(weight[c] for c, off in enumerate(offloaded) if off and not frozen[c])
        device_shards = sum(weight[c] for c, off in enumerate(offloaded) if not off and not frozen[c])
        gpu_adam = device_shards * shard_numel / self.hardware.gpu_adam_elems_per_s
        cpu_adam = host_shards * shard_numel / self.cpu_adam_elems_per_s
        step_time, breakdown = combine_step(
            parts,
            costs,
            gpu_adam,
            cpu_adam,
            mb_compute * accum,
            mb_recompute * accum,
            serial_optimizers=on_cpu,
        )
        tensor_s = accum * self.tensor_comm_s(shape.micro_batch_size, shape.every)
        if tensor_s > 0:
            breakdown["compute_s"] -= tensor_s
            breakdown["tensor_comm_s"] = tensor_s
        expert_s = accum * self.expert_comm_s(shape.micro_batch_size, shape.every)
        if expert_s > 0:  # synchronous on the compute stream: part of the compute above
            breakdown["compute_s"] -= expert_s
            breakdown["expert_comm_s"] = expert_s
        context_s, context_attention_s = (accum * part for part in self.context_s(shape.micro_batch_size, shape.every))
        if context_s + context_attention_s > 0:  # inside attention, on the compute stream: added to the step
            step_time += context_s + context_attention_s
            breakdown["context_comm_s"] = context_s
            if context_attention_s > 0:
                breakdown["context_attention_s"] = context_attention_s
        if shape.layered and accum > 1 and on_cpu and self.parallel_layout.pipeline == 1:
            # Each micro-batch's thread hands the baton on at every hooked module call of its forward
            # (engine/layered.py); on a CPU device the hand-overs hold up the compute itself. A
            # pipeline's schedule orders its micro-batches without threads.
            forward_calls = len(self.profile.trace) // 2
            handoff_s = accum * forward_calls * self.hardware.thread_handoff_s
            step_time += handoff_s
            breakdown["thread_handoff_s"] = handoff_s
        if self.parallel_layout.pipeline > 1:
            extra = self.parallel_costs.pipeline_s(mb_compute * accum, shape.micro_batch_size, accum)
            step_time += sum(extra.values())
            breakdown.update(extra)
        step_time = self._bounded(shape, shard_numel, step_time, breakdown)
        if record is not None:
            record += step_blocks(parts, records, costs, gpu_adam, cpu_adam, on_cpu)
        return StepEstimate(step_time_s=step_time, breakdown=breakdown)

    def _issue_steps(
        self, shape: Shape, traced: int, steady: bool, fetches: list[tuple[int, int, int]], num_steps: int
    ) -> tuple[list[int], list[list[tuple[int, int]]]]:
        """``issue_steps`` and ``issue_groups`` of a cached fetch list (cold or steady), themselves cached:
        candidates that differ only in offload or micro-batch size issue their fetches alike."""
        key = (shape.chunk_size, shape.every, shape.cache_blocks, traced, shape.prefetch, steady)
        if key not in self._issues:
            issue = issue_steps(fetches, shape.prefetch)
            self._issues[key] = (issue, issue_groups(fetches, issue, num_steps))
        return self._issues[key]

    def _bounded(self, shape: Shape, shard_numel: int, step_time_s: float, breakdown: dict[str, float]) -> float:
        """The step time, unchanged, with the plausibility bounds (``rates.plausibility_bound``) in
        ``breakdown`` as a check: ``bound_excess_s`` when the prediction is faster than a bound allows,
        a defect of the model that ``show`` reports (nothing replaces the prediction)."""
        samples_per_gpu = (
            shape.micro_batch_size * shape.grad_accum_steps * self.data_size / self.world_size
        ) / self.parallel_layout.context  # a context rank computes 1/C of each of its group's samples
        trainable_offloaded, frozen_offloaded = self.offloaded_shards(shape)
        bounds = plausibility_bound(
            self.hardware,
            self.dtype,
            useful_flops_per_gpu=self.full_profile.flops_per_sample * samples_per_gpu,
            offloaded_numel_per_rank=(trainable_offloaded + frozen_offloaded) * shard_numel,
            offloaded_trainable_numel_per_rank=trainable_offloaded * shard_numel,
            ranks_on_node=self.gpus_per_node,
            world_size=self.world_size,
            scores_s=sum(self.scores_s_per_flop) * self.full_profile.flops_per_sample * samples_per_gpu,
        )
        breakdown.update({key: value for key, value in bounds.items() if value > 0})
        bound_s = max(bounds.values())
        if bound_s > step_time_s:
            breakdown["bound_excess_s"] = bound_s - step_time_s
        return step_time_s
