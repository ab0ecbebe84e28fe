"""What pipeline and tensor parallelism add to one rank's step, in seconds.

Prices the formulas of ``costmodel/parallel.py`` with the hardware's links:

* tensor-parallel collectives ride the node's GPU links (``allgather_gbps``: NVLink on SXM
  presets, PCIe on PCIe presets; the search keeps T within a node), one ``collective_latency_s``
  each, and sit on the compute stream: a layer's matmul waits for its gathered input;
* a pipeline stage's sends go to the neighbouring stage: on the node's links while a pipeline
  group (P x T consecutive ranks) fits in a node, else over the sending rank's share of the node's
  network (``costmodel/links.py``: the node's other ranks send at the same time). They overlap the
  next micro-batch's compute in a breadth-first schedule; what is exposed is one send per stage hop
  to fill the pipeline and one to drain it, plus whatever the sends take beyond the compute (on a
  CPU device, where gloo sends on the compute cores, all of them);
* the bubble is ``bubble_fraction`` of the step: (P - 1) idle virtual-stage slots, each one
  micro-batch through one virtual stage;
* with 1D sequence parallelism a norm runs on sequence shards, so each norm parameter's gradient
  is a partial sum, all-reduced over the tensor group once per micro-batch (the engine's
  ``local_grad``; measured: 18 all-reduces per micro-batch for the 18 norm parameters of a 4-layer
  GPT-2);
* on a CPU device whose spec carries the probe's layout costs (``hardware/bench_layout.py``), the
  measured costs replace the link-priced ones that they cover: a tensor-split block costs
  ``tensor2_block_fixed_s`` (DTensor dispatch of every op, the collectives' calls and wake-ups)
  plus ``tensor2_block_extra_ratio`` x the whole-width block's time beyond its share of the work
  (collectives' bytes and waits, narrower matrices: the rank's compute is then read at the whole
  block's rate), per micro-batch, every collective of the split included (the blocks' norm-gradient
  all-reduces, the edges' and the final norm's); a pipeline's sends and schedule cost
  ``pipeline_stage_microbatch_s`` per virtual stage and micro-batch plus
  ``pipeline_microbatch_extra_ratio`` x the stage's compute, and the bubble's idle slots are
  slots of that whole busy time;
* the output head under 1D tensor parallelism splits the logits by vocabulary and gathers them whole
  before the model's loss (``engine/parallel/tp_adapters.py``: the vocabulary-parallel loss is opt-in
  and no plan field selects it): one all-gather of micro-batch x seq x vocab elements per micro-batch
  on the last stage, on the compute stream (``logits_gather_s``; on a CPU device with measured
  layout costs its bytes only, its call being in the measured fixed cost);
* a tied parameter held by the first and the last stage (GPT-2's ``wte``) is all-reduced between
  them once per step, after backward;
* a mixture-of-experts block under 1D tensor parallelism (``engine/parallel/tp_experts.py``) sums
  its experts' output with an all-reduce (twice a reduce-scatter's bytes) and its input's gradient
  likewise, where a dense MLP reduce-scatters: the block moves ``TP_MOE_WIRE_FACTOR`` (10/8) of a
  dense block's bytes, in one more collective (the routing weights' gradient);
* expert parallelism's all-to-alls (``costmodel/expert.py``) run on the compute stream, per MoE block
  and micro-batch, on the expert group's links.
"""

from __future__ import annotations

import math

from elixir_tune.costmodel.expert import expert_all_to_all_s
from elixir_tune.costmodel.links import inter_node_bytes_per_s
from elixir_tune.costmodel.parallel import (
    TP_1D_FORWARD_COLLECTIVES,
    Layout,
    bubble_fraction,
    is_gated,
    layer_matmuls,
    p2p_sends_per_micro_batch,
    tp_1d_layer_bytes,
    tp_2d_layer_broadcasts,
    tp_2d_layer_elements,
    tp_boundary_factor,
    tp_efficiency,
    virtual_stages,
)
from elixir_tune.costmodel.stage_profile import tied_params
from elixir_tune.hardware.spec import HardwareSpec
from elixir_tune.plan.schema import DTYPE_BYTES
from elixir_tune.plan.stages import last_stage
from elixir_tune.plan.tensor_layout import has_table, is_norm_param, local_shape, module_style, table_for
from elixir_tune.profiler.schema import ModelProfile

# Collectives of the first and last stage beside the blocks under 1D/2D tensor parallelism: the
# vocabulary-parallel embedding's reduce-scatter (forward) and all-gather (backward), and the
# output head's all-gather of the sequence-sharded hidden states and its reduce-scatter.
TP_EDGE_COLLECTIVES = 2
# Bytes of a mixture-of-experts block's tensor collectives against a dense block's, per layer and
# micro-batch (units of one b x s x h all-gather): dense 2 all-gathers + 2 reduce-scatters forward and
# the same backward (8); the MoE block's MLP gathers its input (1) and all-reduces its output (2)
# forward, and backward gathers the output's gradient (1) and all-reduces the input's (2): 2 + 3 per
# pass with the attention's, 10 in all. Backward also all-reduces the routing weights' gradient (tokens
# x top-k elements: one more collective, its bytes negligible).
TP_MOE_WIRE_FACTOR = 10 / 8
TP_MOE_EXTRA_COLLECTIVES = 1


class ParallelTimes:
    """Tensor and pipeline costs of one rank (one pipeline stage) of one layout."""

    def __init__(
        self,
        full: ModelProfile,
        hardware: HardwareSpec,
        gpus_per_node: int,
        layout: Layout,
        stage: int,
        dtype: str,
    ):
        """Prepares the per-layout constants.

        Args:
            full: the whole model's profile.
            hardware: the node spec.
            gpus_per_node: ranks per node.
            layout: the parallel layout.
            stage: the pipeline stage modelled.
            dtype: compute dtype.
        """
        self.full = full
        self.layout = layout
        self.stage = stage
        self.dtype_bytes = DTYPE_BYTES[dtype]
        self.latency_s = hardware.collective_latency_s
        # On a CPU device the sends run on the compute cores (gloo), so they do not overlap the compute.
        self.serial_sends = hardware.device == "cpu"
        self.hidden = full.arch.hidden_size
        on_cpu = hardware.device == "cpu"
        self.tensor_extra_ratio = hardware.tensor2_block_extra_ratio if on_cpu and layout.tensor > 1 else 0.0
        self.pipeline_extra_ratio = hardware.pipeline_microbatch_extra_ratio if on_cpu else 0.0
        self.tensor_fixed_s = hardware.tensor2_block_fixed_s if on_cpu and layout.tensor > 1 else 0.0
        self.stage_fixed_s = hardware.pipeline_stage_microbatch_s if on_cpu and layout.pipeline > 1 else 0.0
        # Measured layout costs replace the link-priced ones they cover.
        self.measured_tensor = bool(self.tensor_extra_ratio or self.tensor_fixed_s)
        self.measured_pipeline = bool(self.pipeline_extra_ratio or self.stage_fixed_s)
        self.hardware = hardware
        self.dtype = dtype
        arch = full.arch
        if layout.tensor > 1 and not (arch.hidden_size and arch.num_heads):
            raise ValueError(
                f"tensor degree {layout.tensor}: the profile of {full.name} has no hidden size or head count "
                "(profile it again with this elixir-tune, from a transformers model)"
            )
        self.matmuls = layer_matmuls(
            arch.hidden_size,
            arch.intermediate_size or 4 * arch.hidden_size,
            arch.num_heads,
            arch.num_kv_heads or arch.num_heads,
            is_gated(full),
        )
        self.intra_bps = hardware.allgather_gbps * 1e9
        fits_node = layout.model_parallel <= gpus_per_node
        # Off the node a stage's rank sends to the next stage's over its share of the node's network
        # (``costmodel/links.py``): the node's other ranks send at the same time.
        self.pipeline_bps = (
            hardware.allgather_gbps * 1e9 if fits_node else inter_node_bytes_per_s(hardware, gpus_per_node, 1)
        )
        # A measured block-rate curve is read at the rank's (smaller) block already; without one the
        # narrower matrices follow the documented rule.
        has_curve = bool(hardware.block_tflops_curves.get(dtype) or hardware.block_tflops_curves.get("fp32"))
        self.rate_factor = (
            1.0 if has_curve or self.measured_tensor else tp_efficiency(self.hidden, layout.tensor, layout.tensor_mode)
        )
        self.last_stage = last_stage(len(full.blocks), layout.pipeline, layout.assignment)
        edges = (stage == 0) + (stage == self.last_stage)
        self.edge_collectives = TP_EDGE_COLLECTIVES * edges if layout.tensor > 1 else 0
        boundaries = [b.boundary_bytes_per_sample for b in full.blocks]
        boundary = sum(boundaries) / len(boundaries) if boundaries else 0.0
        self.send_bytes_per_sample = boundary * tp_boundary_factor(
            layout.tensor_mode, layout.tensor, layout.sequence_parallel
        )
        self.tied_bytes = (
            sum(
                math.prod(
                    local_shape(
                        full.params[i].name,
                        list(full.params[i].shape),
                        arch.model_type,
                        layout.tensor,
                        layout.tensor_mode,
                        arch.tensor_layout,
                    )
                    if layout.tensor > 1
                    else full.params[i].shape
                )
                for i in tied_params(full, layout)
            )
            * self.dtype_bytes
        )

        self.block_norms_s, self.edge_norms_s = self._norm_allreduces_s(full, layout)
        self.tensor_moe_blocks = self._tensor_moe_blocks(full) if layout.tensor > 1 else frozenset()
        self.gpus_per_node = gpus_per_node

    def _tensor_moe_blocks(self, full: ModelProfile) -> frozenset[int]:
        """Indices of the blocks whose experts the tensor table splits (style ``experts``)."""
        arch = full.arch
        if not has_table(arch.model_type, arch.tensor_layout):
            return frozenset()
        table = table_for(arch.model_type, arch.tensor_layout)
        return frozenset(
            block.index
            for block in full.blocks
            if any(
                module_style(p.name.rpartition(".")[0], table) == "experts"
                for p in full.params[block.first_param : block.first_param + block.num_params]
            )
        )

    def expert_comm_s(self, micro_batch_size: int, moe_blocks: int, recomputed_moe_blocks: int) -> float:
        """Seconds of expert parallelism's all-to-alls in one micro-batch of this rank (on the compute
        stream: the engine runs them synchronously).

        Args:
            micro_batch_size: samples per micro-batch.
            moe_blocks: the rank's blocks with routed experts.
            recomputed_moe_blocks: of which recompute their forward in backward (checkpointed).

        Returns:
            Seconds (0 without expert parallelism).
        """
        arch = self.full.arch
        if self.layout.expert <= 1 or not moe_blocks:
            return 0.0
        block_s, forward_s = expert_all_to_all_s(
            self.layout.expert,
            micro_batch_size * self.full.seq_len,
            arch.hidden_size,
            arch.experts_per_token or 1,
            self.dtype_bytes,
            gpus_per_node=self.gpus_per_node,
            intra_node_bps=self.intra_bps,
            inter_node_bps=self.hardware.inter_node_gbps * 1e9,
            latency_s=self.latency_s,
        )
        return moe_blocks * block_s + recomputed_moe_blocks * forward_s

    def _norm_allreduces_s(self, full: ModelProfile, layout: Layout) -> tuple[float, float]:
        """Seconds of the norm gradients' all-reduces in one micro-batch: (one block's, the norms
        outside the blocks'); zero but with 1D sequence parallelism."""
        if layout.tensor <= 1 or layout.tensor_mode != "1d" or not layout.sequence_parallel:
            return 0.0, 0.0
        in_blocks = {i for b in full.blocks for i in range(b.first_param, b.first_param + b.num_params)}
        first = full.blocks[0] if full.blocks else None
        first_block = set(range(first.first_param, first.first_param + first.num_params)) if first else set()

        def allreduce_s(indices) -> float:
            ring = 2 * (layout.tensor - 1) / layout.tensor  # all-reduce = reduce-scatter + all-gather
            norms = [
                full.params[i]
                for i in indices
                if is_norm_param(full.params[i].name, full.arch.model_type, full.arch.tensor_layout)
            ]
            return sum(self.latency_s + p.numel * self.dtype_bytes * ring / self.intra_bps for p in norms)

        return allreduce_s(sorted(first_block)), allreduce_s(i for i in range(len(full.params)) if i not in in_blocks)

    def communicators(self, data_size: int) -> int:
        """Communication groups of more than one rank this rank belongs to (each holds library buffers)."""
        expert = self.layout.expert
        # Expert parallelism adds the expert group and, when it holds more than one rank, the expert-data group.
        expert_groups = (expert > 1) + (expert > 1 and data_size // expert > 1)
        return (data_size > 1) + (self.layout.tensor > 1) + (self.layout.pipeline > 1) + expert_groups

    def tensor_layer_s(self, micro_batch_size: int) -> tuple[float, float]:
        """(seconds of one layer's forward+backward tensor collectives, the forward's share)."""
        layout = self.layout
        tokens = micro_batch_size * self.full.seq_len
        if layout.tensor <= 1:
            return 0.0, 0.0
        if layout.tensor_mode == "2d":
            q = math.isqrt(layout.tensor)
            wire = tp_2d_layer_elements(tokens, self.matmuls, q) * self.dtype_bytes
            calls = tp_2d_layer_broadcasts(len(self.matmuls), q)
            return calls * self.latency_s + wire / self.intra_bps, 1.0 / 3.0
        wire = tp_1d_layer_bytes(tokens, self.hidden, layout.tensor, self.dtype_bytes)
        return 2 * TP_1D_FORWARD_COLLECTIVES * self.latency_s + wire / self.intra_bps, 0.5

    def full_block_numel(self) -> float:
        """Parameters of the whole model's mean block (where a measured ratio reads the rate)."""
        blocks, params = self.full.blocks, self.full.params
        if not blocks:
            return float(sum(p.numel for p in params))
        return sum(p.numel for b in blocks for p in params[b.first_param : b.first_param + b.num_params]) / len(blocks)

    def plain_block_s(self, micro_batch_size: int) -> float:
        """Forward+backward seconds of the whole model's mean block, unsplit, at the hardware's
        block rate, with its call overhead: what ``tensor2_block_extra_ratio`` is a share of."""
        blocks = self.full.blocks
        if not blocks:
            return 0.0
        fwd_flops = sum(b.fwd_flops_per_sample for b in blocks) / len(blocks)
        rate = self.hardware.compute_tflops(self.dtype, self.full_block_numel()) * 1e12
        return micro_batch_size * 3 * fwd_flops / rate + self.hardware.block_call_overhead_s

    def tensor_comm_s(
        self,
        micro_batch_size: int,
        blocks: int,
        recomputed_blocks: int,
        moe_blocks: int = 0,
        recomputed_moe_blocks: int = 0,
    ) -> float:
        """Seconds of tensor collectives in one micro-batch of this rank.

        Args:
            micro_batch_size: samples per micro-batch.
            blocks: the rank's blocks.
            recomputed_blocks: of which recompute their forward in backward (checkpointed).
            moe_blocks: of the blocks, those whose experts the tensor table splits (``tensor_moe_blocks``).
            recomputed_moe_blocks: of which recompute their forward.

        Returns:
            Seconds (0 without tensor parallelism).
        """
        layer_s, forward_share = self.tensor_layer_s(micro_batch_size)
        if layer_s == 0.0:
            return 0.0
        degree = self.layout.tensor
        moe_extra_s = 0.0
        if moe_blocks and self.layout.tensor_mode == "1d" and not self.measured_tensor:
            # A mixture-of-experts block all-reduces where a dense one reduce-scatters: more bytes, one more call.
            tokens = micro_batch_size * self.full.seq_len
            wire_s = tp_1d_layer_bytes(tokens, self.hidden, degree, self.dtype_bytes) / self.intra_bps
            moe_extra_s = wire_s * (TP_MOE_WIRE_FACTOR - 1) * (moe_blocks + recomputed_moe_blocks * forward_share)
            moe_extra_s += moe_blocks * TP_MOE_EXTRA_COLLECTIVES * self.latency_s
        if self.measured_tensor:
            # Measured on this machine: what the split adds to a block, a fixed cost and a share of
            # the whole-width block's time.
            layer_s = self.tensor_fixed_s + self.tensor_extra_ratio * self.plain_block_s(micro_batch_size)
        # Measured on a CPU, the cost per block holds every collective call of the split: the blocks'
        # norm-gradient all-reduces and the edges' and final norm's (the engine's probe model has 4 blocks,
        # so it spreads those 6 over 4 blocks). Priced apart at the collective latency, which the probe
        # measures between blocks and which under load came out 1.6, 4.9 and 77 ms, they decided the
        # probe's fit of the fixed cost: 24 ms, 5 ms, then 0 (clamped). The edges' bytes (b x s x h each,
        # as the logits' below) grow with the model where the probe's hidden-32 run had next to none:
        # they are priced, their calls are not.
        edge_bytes = micro_batch_size * self.full.seq_len * self.hidden * self.dtype_bytes * (degree - 1) / degree
        edge_call_s = 0.0 if self.measured_tensor else self.latency_s
        edges_s = self.edge_collectives * (edge_call_s + edge_bytes / self.intra_bps)
        norms_s = 0.0
        if not self.measured_tensor:
            norms_s = blocks * self.block_norms_s + (self.edge_norms_s if self.stage == self.last_stage else 0.0)
        recomputed_s = recomputed_blocks * layer_s * forward_share
        return (
            blocks * layer_s + recomputed_s + moe_extra_s + edges_s + norms_s + self.logits_gather_s(micro_batch_size)
        )

    def logits_gather_s(self, micro_batch_size: int) -> float:
        """Seconds of the last stage's all-gather of the vocabulary-split logits in one micro-batch
        (1D tensor parallelism; 0 elsewhere). On a CPU device with measured layout costs the bytes
        only: the call's latency is in the fixed cost the probe measured with the engine."""
        vocab, degree = self.full.arch.vocab_size, self.layout.tensor
        if degree <= 1 or self.layout.tensor_mode != "1d" or self.stage != self.last_stage or not vocab:
            return 0.0
        wire = micro_batch_size * self.full.seq_len * vocab * self.dtype_bytes * (degree - 1) / degree
        return wire / self.intra_bps + (0.0 if self.measured_tensor else self.latency_s)

    def pipeline_s(self, stage_compute_s: float, micro_batch_size: int, micro_batches: int) -> dict[str, float]:
        """What a pipeline adds to the step of one stage.

        Args:
            stage_compute_s: the stage's compute over all micro-batches of the step.
            micro_batch_size: samples per micro-batch.
            micro_batches: N per step.

        Returns:
            ``pipeline_bubble_s``, ``p2p_s`` (exposed sends) and ``tied_allreduce_s``.
        """
        layout = self.layout
        stages, num_blocks = layout.pipeline, len(self.full.blocks)
        virtual = virtual_stages(num_blocks, stages, layout.assignment)
        fraction = bubble_fraction(stages, micro_batches, virtual)
        send_s = self.latency_s + micro_batch_size * self.send_bytes_per_sample / self.pipeline_bps
        sends = 2 * micro_batches * p2p_sends_per_micro_batch(num_blocks, stages, layout.assignment)
        if self.measured_pipeline:
            # Measured on this machine: the schedule and the hand-overs, a fixed cost per virtual
            # stage and micro-batch and a share of the compute; the bubble's slots hold both.
            p2p_s = self.stage_fixed_s * micro_batches * virtual + self.pipeline_extra_ratio * stage_compute_s
            busy_s = stage_compute_s + p2p_s
        elif self.serial_sends:
            p2p_s = (2 * (stages - 1) + sends) * send_s
            busy_s = stage_compute_s
        else:
            p2p_s = 2 * (stages - 1) * send_s + max(0.0, sends * send_s - stage_compute_s)
            busy_s = stage_compute_s
        bubble_s = busy_s * fraction / (1.0 - fraction) if fraction < 1.0 else math.inf
        tied_s = self.latency_s + self.tied_bytes / self.pipeline_bps if self.tied_bytes else 0.0
        return {"pipeline_bubble_s": bubble_s, "p2p_s": p2p_s, "tied_allreduce_s": tied_s}

    def pipeline_factor(self, micro_batches: int) -> float:
        """Step over busy time of the bubble alone, 1 / (1 - bubble fraction): a lower-bound multiplier."""
        layout = self.layout
        num_blocks = len(self.full.blocks)
        fraction = bubble_fraction(
            layout.pipeline, micro_batches, virtual_stages(num_blocks, layout.pipeline, layout.assignment)
        )
        return 1.0 / (1.0 - fraction)
