"""The compute side of one micro-batch: FLOPs at the block rate, attention, recomputation, pointwise ops,
and the tensor- and expert-parallel collectives that sit on the compute stream.

A mixin of ``CostModel`` (costmodel/model.py): it reads the rank's profile, the hardware and the rates
that ``CostModel.__init__`` prepares once per (profile, cluster, dtype, layout).
"""

from __future__ import annotations

from dataclasses import replace

from elixir_tune.costmodel.context import ContextWidths, ExchangeRates, context_exchange
from elixir_tune.costmodel.expert import RankExperts
from elixir_tune.costmodel.gemm_waves import micro_batch_rate_factor
from elixir_tune.costmodel.links import context_link_bytes_per_s
from elixir_tune.costmodel.memory import checkpointed_blocks, selective_line
from elixir_tune.costmodel.parallel_time import ParallelTimes
from elixir_tune.hardware.spec import HardwareSpec
from elixir_tune.profiler.schema import ModelProfile


class ComputeTimes:
    """Seconds of one micro-batch's compute and on-stream collectives (``CostModel`` sets the fields)."""

    profile: ModelProfile
    hardware: HardwareSpec
    dtype: str
    parallel_costs: ParallelTimes
    experts: RankExperts
    attention_share: float
    attention_flops_per_s: float
    scores_s_per_flop: tuple[float, ...]  # (forward, backward) seconds of score traffic per FLOP
    dropout_attention_s_per_sample: float  # a CPU's math-path attention with dropout, one sample
    pointwise_share: float
    _rates: dict[int, float]
    full_profile: ModelProfile
    gpus_per_node: int
    context_widths: ContextWidths
    _context_s: dict[tuple[int, int], tuple[float, float]]
    # (micro-batch size, checkpointing) -> compute_s, tensor_comm_s, expert_comm_s: read for every candidate
    _per_micro_batch: dict[tuple[int, int, bool], tuple[tuple[float, float], float, float]]

    def recompute_share(self, every: int) -> float:
        """The part of all blocks' recomputation that every-k checkpointing does: the checkpointed
        blocks' share of the blocks' forward FLOPs."""
        blocks = self.profile.blocks
        if every <= 0 or not blocks:
            return 0.0
        total = sum(b.fwd_flops_per_sample for b in blocks)
        chosen = sum(b.fwd_flops_per_sample for b in blocks if b.index % every == 0)
        return chosen / total if total else checkpointed_blocks(len(blocks), every) / len(blocks)

    def recompute_flops_per_sample(self, every: int, selective: bool = False) -> float:
        """Extra forward FLOPs per sample of every-k checkpointing: the profile's figure for all
        blocks (``selective``: for all blocks under torchtitan's per-op policy, the matrix products it
        does not save), shared out by the checkpointed blocks' forward FLOPs."""
        if selective:
            return selective_line(self.profile).recompute_flops_per_sample * self.recompute_share(every)
        full = self.profile.recompute_flops_per_sample or sum(b.fwd_flops_per_sample for b in self.profile.blocks)
        return full * self.recompute_share(every)

    def pointwise_s(self, micro_batch_size: int, every: int, selective: bool = False) -> tuple[float, float]:
        """Seconds of one micro-batch's memory-bound pointwise ops at the hardware's pointwise rate:
        (forward+backward, recomputation), for the share of them beyond those the rate includes
        (``pointwise_beyond_rate``); (0, 0) when the hardware has no such rate (then the block rate
        stands for them). ``selective``: the recomputation's bytes traced under torchtitan's per-op policy."""
        rate_bps = self.hardware.pointwise_gbps * 1e9
        if rate_bps <= 0 or self.pointwise_share <= 0:
            return 0.0, 0.0
        profile = self.profile
        all_blocks = (
            selective_line(profile).recompute_pointwise_bytes_per_sample
            if selective and every > 0
            else profile.recompute_pointwise_bytes_per_sample
        )
        recompute_bytes = all_blocks * self.recompute_share(every)
        return (
            micro_batch_size * profile.pointwise_bytes_per_sample * self.pointwise_share / rate_bps,
            micro_batch_size * recompute_bytes * self.pointwise_share / rate_bps,
        )

    def block_numel(self) -> float:
        """Parameters of the mean block (of the whole model when the profile found no blocks):
        where the block-rate curve is read."""
        blocks = self.profile.blocks
        params = self.profile.params
        if not blocks:
            return float(sum(p.numel for p in params))
        total = sum(p.numel for b in blocks for p in params[b.first_param : b.first_param + b.num_params])
        return total / len(blocks)

    def flops_per_s_at(self, micro_batch_size: int) -> float:
        """Compute rate (cached). On a block curve narrow models run slower. On a GPU the micro-batch's
        tokens set how full the last wave of each GEMM's tiles runs (``gemm_waves.micro_batch_rate_factor``,
        over the hardware's ``sm_count``); on a CPU (no SMs) the micro-batch does not change the rate
        (measured: a 256-wide block at 128 and 512 tokens per call ran within 1.3x, and plain PyTorch at
        micro-batch 2x4 as fast as 8x1)."""
        if micro_batch_size not in self._rates:
            costs = self.parallel_costs
            # A measured tensor-split ratio covers the narrower matrices: read the whole block's rate.
            numel = costs.full_block_numel() if costs.measured_tensor else self.block_numel()
            tflops = self.hardware.compute_tflops(self.dtype, numel) * costs.rate_factor
            waves = micro_batch_rate_factor(self.profile, micro_batch_size, costs.layout.tensor, self.hardware.sm_count)
            self._rates[micro_batch_size] = tflops * waves * 1e12
        return self._rates[micro_batch_size]

    def compute_s(self, micro_batch_size: int, every: int, selective: bool = False) -> tuple[float, float]:
        """(compute, recompute part) seconds of one micro-batch (cached: ``_compute_s``); ``selective``:
        the checkpointed blocks keep torchtitan's per-op saves."""
        return self._micro_batch_times(micro_batch_size, every, selective)[0]

    def tensor_comm_s(self, micro_batch_size: int, every: int) -> float:
        """Seconds of tensor-parallel collectives in one micro-batch (recomputed blocks' forwards included)."""
        return self._micro_batch_times(micro_batch_size, every)[1]

    def expert_comm_s(self, micro_batch_size: int, every: int) -> float:
        """Seconds of expert parallelism's all-to-alls in one micro-batch (recomputed blocks' forwards
        included; 0 without expert parallelism)."""
        return self._micro_batch_times(micro_batch_size, every)[2]

    def _micro_batch_times(
        self, micro_batch_size: int, every: int, selective: bool = False
    ) -> tuple[tuple[float, float], float, float]:
        """``compute_s``, ``tensor_comm_s`` and ``expert_comm_s`` of one (micro-batch size, checkpointing),
        computed once: every candidate the search scores reads them."""
        key = (micro_batch_size, every, selective)
        if key not in self._per_micro_batch:
            tensor_s = self._tensor_comm_s(micro_batch_size, every)
            expert_s = self._expert_comm_s(micro_batch_size, every)
            self._per_micro_batch[key] = (
                self._compute_s(micro_batch_size, every, tensor_s + expert_s, selective),
                tensor_s,
                expert_s,
            )
        return self._per_micro_batch[key]

    def _compute_s(
        self, micro_batch_size: int, every: int, communication_s: float, selective: bool = False
    ) -> tuple[float, float]:
        """(compute, recompute part) seconds of one micro-batch; ``communication_s``: its tensor- and
        expert-parallel collectives.

        The matrix products' FLOPs at the block rate (``flops_per_s_at``), the attention products'
        at the hardware's attention rate when it has one (``rates.attention_flops_share``; the
        share grows with the sequence); recomputation is the checkpointed blocks' forward FLOPs
        again, split the same way, at ``recompute_speedup`` over those rates. An eager attention's
        scores move through HBM at ``hbm_gbps`` beside a fused attention rate
        (``rates.attention_scores_bytes``; recomputed with their blocks' forward); on a CPU device an attention with dropout runs the math path, its score
        elements at ``dropout_attention_s_per_score`` (a third again where recomputed). The
        model's own pointwise ops at the pointwise rate (the block rate is net of the probe
        block's, ``pointwise_s``); plus the hardware's per-call overhead
        for each block's forward+backward, and half of it for each recomputed block's forward (a
        forward runs about half of a forward+backward's ops): it is what makes small
        micro-batches of small models slow. Tensor-parallel collectives sit on the compute stream
        (each matmul waits for its inputs), so they are part of it here (``tensor_comm_s`` says how
        much).

        Selective checkpointing (torchtitan's per-op policy) recomputes only what it does not save,
        as its own traced pass counted it (``ModelProfile.selective``): every other matrix product
        at the block rate and the memory-bound ops (norms, activations, residual adds) at the
        pointwise rate; the attention kernel's output is saved, so no attention runs again.
        """
        rate = self.flops_per_s_at(micro_batch_size)
        overhead_s = self.hardware.block_call_overhead_s
        blocks = len(self.profile.blocks)
        recomputed = checkpointed_blocks(blocks, every) if every > 0 else 0
        pointwise, pointwise_recompute = self.pointwise_s(micro_batch_size, every, selective)
        flops = micro_batch_size * self.profile.flops_per_sample
        recompute_flops = micro_batch_size * self.recompute_flops_per_sample(every, selective)
        share = self.attention_share
        # The recomputed forward's attention: a third of the blocks' attention FLOPs, for the
        # checkpointed blocks' share of them (none under selective checkpointing: its output is kept).
        recompute_attention = (
            0.0 if selective else min(recompute_flops, flops * share / 3 * self.recompute_share(every))
        )
        attention_s = flops * share / self.attention_flops_per_s if share else 0.0
        recompute_attention_s = recompute_attention / self.attention_flops_per_s if share else 0.0
        scores_forward, scores_backward = (flops * s_per_flop for s_per_flop in self.scores_s_per_flop)
        # A CPU's attention with dropout (math path); a recomputed block's forward, about a third of it, again.
        dropout_s = micro_batch_size * self.dropout_attention_s_per_sample
        # A recomputed forward runs faster per FLOP than the forward+backward mean the rates give.
        speedup = self.hardware.recompute_speedup
        recompute = (
            ((recompute_flops - recompute_attention) / rate + recompute_attention_s) / speedup
            + recomputed * overhead_s / 2
            + pointwise_recompute
            + scores_forward * self.recompute_share(every)
            + dropout_s * self.recompute_share(every) / 3
        )
        compute = (
            flops * (1 - share) / rate
            + attention_s
            + scores_forward
            + scores_backward
            + dropout_s
            + blocks * overhead_s
            + pointwise
            + recompute
        )
        return compute + communication_s, recompute

    def _tensor_comm_s(self, micro_batch_size: int, every: int) -> float:
        """``tensor_comm_s``, computed."""
        blocks = self.profile.blocks
        recomputed = {b.index for b in blocks if every > 0 and b.index % every == 0}
        moe = self.parallel_costs.tensor_moe_blocks
        return self.parallel_costs.tensor_comm_s(
            micro_batch_size,
            len(blocks),
            len(recomputed),
            sum(1 for b in blocks if b.index in moe),
            len(recomputed & moe),
        )

    def _expert_comm_s(self, micro_batch_size: int, every: int) -> float:
        """``expert_comm_s``, computed."""
        moe_blocks = self.experts.moe_blocks
        recomputed = sum(1 for b in moe_blocks if every > 0 and b % every == 0)
        return self.parallel_costs.expert_comm_s(micro_batch_size, len(moe_blocks), recomputed)

    def context_comm_s(self, micro_batch_size: int, every: int) -> float:
        """Seconds of one micro-batch's context exchange on this rank, what compute does not hide
        (0 at C = 1)."""
        return self.context_s(micro_batch_size, every)[0]

    def context_s(self, micro_batch_size: int, every: int) -> tuple[float, float]:
        """(exchange, extra attention) seconds of one micro-batch on this rank (``costmodel/context.py``;
        recomputed blocks' forwards included; cached), (0, 0) at C = 1."""
        layout = self.parallel_costs.layout
        if layout.context <= 1:
            return 0.0, 0.0
        key = (micro_batch_size, every)
        if key not in self._context_s:
            blocks = self.profile.blocks if self.full_profile.arch.num_heads else []
            recomputed = sum(1 for b in blocks if every > 0 and b.index % every == 0)
            rates = ExchangeRates(
                context_link_bytes_per_s(
                    self.hardware, self.gpus_per_node, layout.context, layout.tensor, layout.context_mode
                ),
                self.hardware.collective_latency_s,
                self.hardware.hbm_gbps * 1e9,
                overlaps=self.hardware.device != "cpu",
            )
            exchange = context_exchange(
                self.context_widths, micro_batch_size, self.attention_forward_s(micro_batch_size), rates
            )
            whole = exchange.step_s(len(blocks), recomputed)
            extra = replace(exchange, forward_s=0.0, backward_s=0.0).step_s(len(blocks), recomputed)
            self._context_s[key] = (whole - extra, extra)
        return self._context_s[key]

    def attention_forward_s(self, micro_batch_size: int) -> float:
        """The rank's attention products of one block's forward for one micro-batch: 4 x S^2 x h FLOPs
        per sample (the non-causal count the attention rate is fitted to, ``rates.attention_flops_share``)
        over C and T, at the attention rate (the block rate where the hardware has none)."""
        widths = self.context_widths
        flops = micro_batch_size * 4 * widths.seq_len**2 * widths.q_width / max(widths.degree, 1)
        return flops / (self.attention_flops_per_s or self.flops_per_s_at(micro_batch_size))
