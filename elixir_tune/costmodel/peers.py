"""Step time and memory of a data-parallel plan run by a peer engine: PyTorch FSDP2 or DeepSpeed ZeRO.

Priced with the rates our own model uses (``CostModel``: compute per micro-batch, the hardware's
collective bandwidths and latency, host<->device links, device and host Adam), so that the peers and
our engine are ranked on one scale. What each peer does per step:

FSDP2 (``fully_shard`` on every block, then on the root for the rest: embeddings, final norm, head):

* forward: one all-gather per unit in the compute dtype (``MixedPrecisionPolicy.param_dtype``), the
  next unit's issued while the current one computes (one unit ahead);
* backward: the units in reverse, gathered again when ``reshard_after_forward`` (the root never is:
  torch's ``_fsdp_state.py`` keeps the root unsharded after forward, as training needs it at once),
  then one reduce-scatter per unit in fp32 (``reduce_dtype`` float32 as our runner sets it), on its
  own stream; every micro-batch gathers and reduces (no ``set_requires_gradient_sync`` skip);
* ``CPUOffloadPolicy`` per unit (the first ``offload_units``, else all): the fp32 shard uploaded
  before each gather, the reduced fp32 gradient shard copied down, and the unit's optimizer step on
  the host at the host Adam rate;
* memory: fp32 shards of parameters, gradients and Adam's two moments (16 bytes an element over the
  world), two gathered units (current and prefetched; every unit at once from forward to backward
  without resharding), one unit's unsharded fp32 gradient, and the activations.

DeepSpeed ZeRO (``deepspeed/runtime/zero/config.py`` of deepspeed 0.19.8, as installed here, and
https://www.deepspeed.ai/docs/config-json/): stage 1 shards the optimizer states, 2 the gradients too,
3 the parameters too (ZeRO paper, Rajbhandari et al. 2020: memory (2 + 2 + K) x params over the
stages). Gradients are reduced in buckets of ``reduce_bucket_size`` (one collective each); stage 1
reduces once per step (gradients accumulate whole), 2 and 3 every micro-batch. ``overlap_comm``
defaults to on at stage 3 only, so stages 1-2 reduce on the compute's path. Stages 1-2 all-gather
the updated parameters after the step. Stage 3 gathers parameters module by module, prefetching up
to ``stage3_prefetch_bucket_size`` ahead; a parameter reused within ``stage3_max_reuse_distance``
elements is kept, so a model of fewer elements than half of it is gathered once per micro-batch and
held from forward to backward (capped at ``stage3_max_live_parameters``); parameters below
``stage3_param_persistence_threshold`` elements stay whole on every rank. Offload: the optimizer
states and step on the host with DeepSpeed's CPU Adam (``offload_optimizer``), gradient shards copied
down and updated parameters up; stage 3 parameters on the host too (``offload_param``).

On a CPU device collectives run on the compute's cores and host copies cost nothing (one memory), as
in ``costmodel/timeline.py``. Imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elixir_tune.costmodel.links import inter_node_bytes_per_s
from elixir_tune.costmodel.memory import MemoryEstimate, activation_bytes, margin_bytes
from elixir_tune.costmodel.model import CostModel
from elixir_tune.costmodel.shape import StepEstimate
from elixir_tune.plan.engine_choice import EngineChoice
from elixir_tune.plan.schema import DTYPE_BYTES

# DeepSpeed's defaults (deepspeed/runtime/zero/config.py, deepspeed 0.19.8; the config-json page):
DS_REDUCE_BUCKET_ELEMENTS = int(5e8)  # reduce_bucket_size
DS_ALLGATHER_BUCKET_ELEMENTS = int(5e8)  # allgather_bucket_size (stages 1-2, after the step)
DS_PREFETCH_BUCKET_ELEMENTS = int(5e7)  # stage3_prefetch_bucket_size
DS_MAX_LIVE_ELEMENTS = int(1e9)  # stage3_max_live_parameters
DS_MAX_REUSE_DISTANCE = int(1e9)  # stage3_max_reuse_distance
DS_PERSISTENCE_THRESHOLD = int(1e5)  # stage3_param_persistence_threshold
FP32_BYTES = 4
ADAM_MOMENT_BYTES = 8  # exp_avg and exp_avg_sq, fp32, in torch's AdamW and DeepSpeed's CPU Adam alike


@dataclass(frozen=True)
class PeerShape:
    """A peer candidate: the engine's settings and the batch and checkpointing choices.

    Attributes:
        engine: the engine and its settings (``plan.engine_choice.EngineChoice``).
        micro_batch_size: samples per micro-batch.
        grad_accum_steps: micro-batches per step.
        every: activation checkpointing (0 none, k every k-th block).
    """

    engine: EngineChoice
    micro_batch_size: int
    grad_accum_steps: int
    every: int

    def __hash__(self) -> int:  # EngineChoice is a mutable dataclass: hash its fields
        return hash((tuple(vars(self.engine).items()), self.micro_batch_size, self.grad_accum_steps, self.every))


def describe(engine: EngineChoice) -> str:
    """A short name of a peer's settings, e.g. ``fsdp2 reshard offload`` or ``deepspeed z3 offload-opt``."""
    if engine.name == "fsdp2":
        words = ["fsdp2", "reshard" if engine.reshard_after_forward else "no-reshard"]
        if engine.offload_params:
            words.append("offload" + (f"{engine.offload_units}" if engine.offload_units else ""))
        return " ".join(words)
    if engine.name == "deepspeed":
        words = ["deepspeed", f"z{engine.zero_stage}"]
        if engine.offload_params:
            words.append("offload-param")
        if engine.offload_optimizer:
            words.append("offload-opt")
        return " ".join(words)
    return engine.name


class PeerModel:
    """Prices peer candidates with a data-parallel ``CostModel``'s rates.

    Args:
        model: a cost model without pipeline, tensor, context or expert parallelism.

    Raises:
        ValueError: the model has another layout (the peers run data-parallel plans only).
    """

    def __init__(self, model: CostModel):
        if model.data_size != model.world_size:
            raise ValueError("the peer engines run data-parallel plans only")
        self.model = model
        self.hardware = model.hardware
        self.world = model.world_size
        self.dtype_bytes = DTYPE_BYTES[model.dtype]
        self.on_cpu = model.hardware.device == "cpu"
        profile = model.profile
        trainable = [p for p in profile.params if p.requires_grad]
        self.param_numels = [p.numel for p in trainable]
        self.total_numel = sum(self.param_numels)
        blocks = [
            sum(p.numel for p in profile.params[b.first_param : b.first_param + b.num_params] if p.requires_grad)
            for b in profile.blocks
        ]
        # FSDP2's units in forward order: the root's own parameters run first (embeddings) and last
        # (head); they are gathered once, before the first block, as the root's pre-forward does.
        self.units = [max(0, self.total_numel - sum(blocks)), *blocks]
        flops = profile.flops_per_sample or 1.0
        block_shares = [3 * b.fwd_flops_per_sample / flops for b in profile.blocks]
        self.compute_shares = [max(0.0, 1.0 - sum(block_shares)), *block_shares]

    # -- rates -------------------------------------------------------------------------------------

    def _collective_s(self, numel: float, element_bytes: int, gather: bool, ops: int = 1) -> float:
        """One or ``ops`` ring collectives moving ``numel`` elements in all (0 at world 1)."""
        if self.world <= 1 or numel <= 0:
            return 0.0
        hw = self.hardware
        if self.model.nodes > 1:
            rate = inter_node_bytes_per_s(hw, self.model.gpus_per_node, self.model.gpus_per_node)
        else:
            rate = (hw.allgather_gbps if gather else hw.reduce_scatter_gbps) * 1e9
        return ops * hw.collective_latency_s + numel * element_bytes * (self.world - 1) / self.world / rate

    def _copy_s(self, numel: float, element_bytes: int, up: bool) -> float:
        """A host<->device copy (nothing on a CPU device, whose host is its memory)."""
        if self.on_cpu or numel <= 0:
            return 0.0
        hw = self.hardware
        several = self.model.gpus_per_node > 1
        gbps = (hw.h2d_gbps_all if several else hw.h2d_gbps) if up else (hw.d2h_gbps_all if several else hw.d2h_gbps)
        return hw.copy_latency_s + numel * element_bytes / (gbps * 1e9)

    def _compute_loss_s(self, collective_s: float, compute_s: float) -> float:
        """What one micro-batch's collectives running beside its compute take from it
        (``HardwareSpec.collective_compute_loss``; none on a CPU, where they stall it outright)."""
        if self.on_cpu or self.world <= 1:
            return 0.0
        return self.hardware.collective_compute_loss * min(collective_s, compute_s)

    def _adam_s(self, device_numel: float, host_numel: float) -> tuple[float, float]:
        """Device and host Adam seconds of a rank's shard."""
        return device_numel / self.hardware.gpu_adam_elems_per_s, host_numel / self.model.cpu_adam_elems_per_s

    def _optimizer_s(self, device_numel: float, host_numel: float, breakdown: dict[str, float]) -> float:
        """The step's optimizer part: both Adams in parallel on a GPU machine, one after the other on a CPU."""
        gpu_adam, cpu_adam = self._adam_s(device_numel, host_numel)
        breakdown["gpu_adam_s"], breakdown["cpu_adam_s"] = gpu_adam, cpu_adam
        return gpu_adam + cpu_adam if self.on_cpu else max(gpu_adam, cpu_adam)

    # -- FSDP2 -------------------------------------------------------------------------------------

    def _fsdp2_offloaded(self, engine: EngineChoice) -> list[bool]:
        count = len(self.units) if engine.offload_units is None else engine.offload_units
        return [engine.offload_params and index < count for index in range(len(self.units))]

    def _fsdp2_step(self, shape: PeerShape) -> StepEstimate:
        engine, world = shape.engine, self.world
        compute_s, recompute_s = self.model.compute_s(shape.micro_batch_size, shape.every)
        offloaded = self._fsdp2_offloaded(engine)
        forward_compute = [(compute_s - recompute_s) / 3 * share for share in self.compute_shares]
        backward_compute = [(compute_s - recompute_s) * 2 / 3 * share for share in self.compute_shares]
        if recompute_s:  # the recomputed forwards run in backward, with their units' share
            backward_compute = [
                b + recompute_s * share for b, share in zip(backward_compute, self.compute_shares, strict=True)
            ]
        upload = [
            self._copy_s(n / world, FP32_BYTES, up=True) if off else 0.0
            for n, off in zip(self.units, offloaded, strict=True)
        ]
        gather = [
            self._collective_s(n, self.dtype_bytes, gather=True) + u for n, u in zip(self.units, upload, strict=True)
        ]
        regather = [g if engine.reshard_after_forward and index else 0.0 for index, g in enumerate(gather)]
        reduce = [self._collective_s(n, FP32_BYTES, gather=False) for n in self.units]
        download = [
            self._copy_s(n / world, FP32_BYTES, up=False) if off else 0.0
            for n, off in zip(self.units, offloaded, strict=True)
        ]
        reduce = [r + d for r, d in zip(reduce, download, strict=True)]
        forward_s = _overlapped(gather, forward_compute, self.on_cpu)
        backward_s = _overlapped(regather[::-1], backward_compute[::-1], self.on_cpu, after=reduce[::-1])
        lost_s = self._compute_loss_s(sum(gather) + sum(regather) + sum(reduce), compute_s)
        micro_s = forward_s + backward_s + lost_s
        breakdown = {
            "collective_compute_loss_s": lost_s * shape.grad_accum_steps,
            "compute_s": compute_s * shape.grad_accum_steps,
            "allgather_s": (sum(gather) + sum(regather)) * shape.grad_accum_steps,
            "reduce_scatter_s": sum(reduce) * shape.grad_accum_steps,
        }
        host = sum(n for n, off in zip(self.units, offloaded, strict=True) if off) / world
        norm_s = self._collective_s(1, FP32_BYTES, gather=False)
        step = (
            micro_s * shape.grad_accum_steps
            + norm_s
            + self._optimizer_s(self.total_numel / world - host, host, breakdown)
        )
        breakdown["exposed_comm_s"] = max(0.0, micro_s * shape.grad_accum_steps - breakdown["compute_s"])
        return StepEstimate(step_time_s=step, breakdown=breakdown)

    def _fsdp2_memory(self, shape: PeerShape) -> MemoryEstimate:
        engine, world = shape.engine, self.world
        offloaded = self._fsdp2_offloaded(engine)
        state_bytes = 2 * FP32_BYTES + ADAM_MOMENT_BYTES  # fp32 parameter and gradient shards, two moments
        host_numel = sum(n for n, off in zip(self.units, offloaded, strict=True) if off) / world
        device_numel = self.total_numel / world - host_numel
        largest = sorted(self.units, reverse=True)
        if engine.reshard_after_forward:  # the root stays gathered; a block and the one prefetched
            gathered = (self.units[0] + sum(sorted(self.units[1:])[-2:])) * self.dtype_bytes
        else:  # every unit stays gathered from its forward to its backward
            gathered = self.total_numel * self.dtype_bytes
        return self._estimate(
            shape,
            cache_bytes=gathered,
            device_state_bytes=int(device_numel * state_bytes),
            host_bytes=int(host_numel * state_bytes),
            staging_bytes=largest[0] * FP32_BYTES,  # one unit's unsharded fp32 gradient before its reduce
            largest_unit=largest[0],
        )

    # -- DeepSpeed ---------------------------------------------------------------------------------

    def _persistent_numel(self) -> int:
        return sum(n for n in self.param_numels if n < DS_PERSISTENCE_THRESHOLD)

    def _deepspeed_step(self, shape: PeerShape) -> StepEstimate:
        engine, world, accum = shape.engine, self.world, shape.grad_accum_steps
        compute_s, _ = self.model.compute_s(shape.micro_batch_size, shape.every)
        bucket = engine.reduce_bucket_elements or DS_REDUCE_BUCKET_ELEMENTS
        buckets = math.ceil(self.total_numel / bucket)
        reduce_once = self._collective_s(self.total_numel, self.dtype_bytes, gather=False, ops=buckets)
        reductions = 1 if engine.zero_stage == 1 else accum
        reduce_s = reduce_once * reductions
        gather_s = once = 0.0
        ops, kept = 1, True
        shard = self.total_numel / world
        if engine.zero_stage < 3:
            gather_ops = math.ceil(self.total_numel / DS_ALLGATHER_BUCKET_ELEMENTS)
            gather_s = self._collective_s(self.total_numel, self.dtype_bytes, gather=True, ops=gather_ops)
        else:
            sharded = self.total_numel - self._persistent_numel()
            ops = sum(1 for n in self.param_numels if n >= DS_PERSISTENCE_THRESHOLD)
            once = self._collective_s(sharded, self.dtype_bytes, gather=True, ops=ops)
            if engine.offload_params:
                once += self._copy_s(sharded / world, self.dtype_bytes, up=True)
            # Kept from forward to backward when every reuse lies within the distance and the cap.
            live = engine.max_live_elements or DS_MAX_LIVE_ELEMENTS
            kept = 2 * sharded <= DS_MAX_REUSE_DISTANCE and sharded <= live
            gather_s = once * (1 if kept else 2) * accum
        offload_s = 0.0
        if engine.offload_optimizer:  # gradient shards down, updated parameters up, once per step
            offload_s = self._copy_s(shard, FP32_BYTES, up=False) + self._copy_s(shard, self.dtype_bytes, up=True)
        breakdown = {"compute_s": compute_s * accum, "reduce_scatter_s": reduce_s, "allgather_s": gather_s}
        if engine.zero_stage == 3 and not self.on_cpu:
            # overlap_comm (on at stage 3): a micro-batch's forward gathers run beside its forward, its
            # reductions (and gathers again) beside its backward; the first gather and the last bucket
            # have nothing to hide behind.
            regather = 0.0 if kept else once
            backward_comm = regather + reduce_once
            lost_s = self._compute_loss_s(once + backward_comm, compute_s)
            micro_s = (
                max(compute_s / 3, once)
                + once / max(1, ops)
                + max(compute_s * 2 / 3, backward_comm)
                + reduce_once / buckets
                + lost_s
            )
            micro_total = micro_s * accum
            breakdown["collective_compute_loss_s"] = lost_s * accum
        else:
            micro_total = compute_s * accum + gather_s + reduce_s
        host = shard if engine.offload_optimizer else 0.0
        norm_s = self._collective_s(1, FP32_BYTES, gather=False)
        step = micro_total + offload_s + norm_s + self._optimizer_s(shard - host, host, breakdown)
        breakdown["offload_copy_s"] = offload_s
        breakdown["exposed_comm_s"] = micro_total - compute_s * accum
        return StepEstimate(step_time_s=step, breakdown=breakdown)

    def _deepspeed_memory(self, shape: PeerShape) -> MemoryEstimate:
        engine, world, total = shape.engine, self.world, self.total_numel
        db = self.dtype_bytes
        # K: Adam's moments, and an fp32 master copy when the compute dtype is narrower (ZeRO paper's 12).
        optimizer_bytes = ADAM_MOMENT_BYTES + (FP32_BYTES if db < FP32_BYTES else 0)
        stage = engine.zero_stage
        params = (
            total * db if stage < 3 else (total - self._persistent_numel()) / world * db + self._persistent_numel() * db
        )
        grads = total * db if stage == 1 else total / world * db
        optimizer = total / world * optimizer_bytes
        bucket = min(total, engine.reduce_bucket_elements or DS_REDUCE_BUCKET_ELEMENTS) * db if stage > 1 else 0
        host = 0.0
        if engine.offload_optimizer:  # the fp32 states and the fp32 gradient shard move to the host
            host += optimizer + total / world * FP32_BYTES
            optimizer = 0
        if engine.offload_params and stage == 3:
            host += params - self._persistent_numel() * db
            params = self._persistent_numel() * db
        cache = 0
        if stage == 3:
            sharded = total - self._persistent_numel()
            live = min(sharded, engine.max_live_elements or DS_MAX_LIVE_ELEMENTS)
            kept = 2 * sharded <= DS_MAX_REUSE_DISTANCE
            prefetch = engine.prefetch_bucket_elements or DS_PREFETCH_BUCKET_ELEMENTS
            largest = max(self.units)
            cache = int((live if kept else min(live, prefetch + 2 * largest)) * db)
        elif stage < 3:  # every rank holds the whole model's parameters: reported as gathered
            cache, params = int(params), 0
        return self._estimate(
            shape,
            cache_bytes=cache,
            device_state_bytes=int(params + grads + optimizer),
            host_bytes=int(host),
            staging_bytes=int(bucket),  # the reduce bucket (contiguous_gradients)
            largest_unit=max(self.units),
        )

    # -- shared ------------------------------------------------------------------------------------

    def _estimate(
        self,
        shape: PeerShape,
        *,
        cache_bytes: int,
        device_state_bytes: int,
        host_bytes: int,
        staging_bytes: int,
        largest_unit: int,
    ) -> MemoryEstimate:
        """The estimate in the plan's keys (gathered parameters as ``cache_bytes``, the unsharded gradient
        or reduce bucket as ``staging_bytes``), with activations (``costmodel/memory.py``), buffers and
        the margin."""
        model, profile = self.model, self.model.profile
        activations = activation_bytes(profile, shape.micro_batch_size, shape.every, model.dtype, model.hardware.device)
        buffers = profile.buffers_bytes
        margin = margin_bytes(
            model.hardware.device,
            model.hardware.gpu_memory_bytes,
            self.world,
            largest_unit,
            model.dtype,
            1,
            model.hardware.allocator_overhead_bytes,
        )
        peak = cache_bytes + device_state_bytes + staging_bytes + activations + buffers
        return MemoryEstimate(
            model_state_bytes={
                "cache_bytes": int(cache_bytes),
                "resident_bytes": 0,
                "device_shard_bytes": int(device_state_bytes),
                "host_shard_bytes": int(host_bytes),
            },
            frozen_bytes=0,
            activation_bytes=activations,
            buffer_bytes=buffers,
            margin_bytes=margin,
            peak_gpu_bytes=peak,
            peak_host_bytes=host_bytes * model.gpus_per_node,
            transient_bytes={
                "staging_bytes": int(staging_bytes),
                "host_copy_bytes": 0,
                "landing_bytes": 0,
                "held_grad_bytes": 0,
            },
        )

    def step_time(self, shape: PeerShape) -> StepEstimate:
        """Predicted step time of a peer candidate (``fsdp2`` or ``deepspeed``)."""
        if shape.engine.name == "fsdp2":
            return self._fsdp2_step(shape)
        if shape.engine.name == "deepspeed":
            return self._deepspeed_step(shape)
        raise ValueError(f"engine {shape.engine.name}: priced by CostModel, not PeerModel")

    def memory(self, shape: PeerShape) -> MemoryEstimate:
        """Predicted peak memory of a peer candidate (device per rank, host per node)."""
        if shape.engine.name == "fsdp2":
            return self._fsdp2_memory(shape)
        if shape.engine.name == "deepspeed":
            return self._deepspeed_memory(shape)
        raise ValueError(f"engine {shape.engine.name}: priced by CostModel, not PeerModel")


def _overlapped(comm: list[float], compute: list[float], serial: bool, after: list[float] | None = None) -> float:
    """Seconds of one pass over the units: each unit's gather (issued one unit ahead, on its own
    stream) before its compute, and ``after`` (its reduce-scatter, on another stream) once its compute
    ends. ``serial`` (a CPU device): everything on the compute's cores, one after the other."""
    after = after or [0.0] * len(comm)
    if serial:
        return sum(comm) + sum(compute) + sum(after)
    comm_done = compute_done = previous_start = reduce_done = 0.0
    for gather_s, compute_s, reduce_s in zip(comm, compute, after, strict=True):
        comm_done = max(comm_done, previous_start) + gather_s
        previous_start = max(compute_done, comm_done)
        compute_done = previous_start + compute_s
        reduce_done = max(reduce_done, compute_done) + reduce_s
    return max(compute_done, reduce_done)
