"""Context parallelism (``parallel.context``) in the cost model: what a rank computes and keeps, and
what its key/value exchange costs in each mode.

**Share.** A rank of a context group of C computes 1/C of every sample's tokens with the whole
model's weights: its linear layers see S / C tokens, and its attention does 1/C of the causal work
(Ulysses: every token for H / C heads; ring and all-gather: the load-balanced causal split, chunks i
and 2C - 1 - i of 2C, so each rank has as many early as late queries). So every per-sample figure of
the profile (FLOPs, pointwise bytes, activations, each block's bytes) is 1/C of the whole model's,
and ``seq_len`` is the rank's S / C (``context_share``). The chunks shard over data x context, the
cost model's ``data_size`` (world / (P x T)) unchanged.

**Exchange, per attention block and micro-batch** (b x S / C tokens ``n`` per rank, q and the output
``w_q`` wide, k and v ``w_kv`` wide each, ``e`` bytes per element, C ranks; ``context_exchange``):

* ``ulysses`` (engine/comm/context.py): forward four all-to-alls (q, k, v before attention, the
  output after), each rank sending (C - 1) / C of n x (2 w_q + 2 w_kv) x e bytes; backward the same;
  a recomputed block's forward once more. Each exchange also copies its tensor twice on the device
  (the send rows made contiguous, the received rows permuted back).
* ``allgather`` (engine/parallel/context_parallel.py): forward all-gathers of k and v, (C - 1) x n x
  2 w_kv x e bytes into each rank; backward reduce-scatters their gradients (the same bytes). The
  local queries then attend over the whole sequence with an explicit mask, so the kernel computes
  every score of the rank's rows, the causal half it throws away included: the rank's attention
  compute is done twice over (``attention_extra_s``), and the gathered k, v and the mask (n x S
  elements) are kept for backward by every block that is not recomputed (``held_bytes_per_sample``).
* ``ring`` (torch's ``_templated_ring_attention``, Liu et al., "Ring Attention", arXiv 2310.01889):
  C steps, each attending the local queries to one rank's k/v block (1/C of the rank's attention,
  equal steps under the load-balanced split) while the next block travels to the next rank: forward
  C - 1 sends of n x 2 w_kv x e bytes, each step max(compute, send); backward C - 1 sends of the block
  and of its fp32 gradient, and one more gradient send to return it home, exposed. The merge of
  the partial outputs (fp32) and the concatenation of each block before its send are device copies.

All three run inside attention on the compute stream, so what is not overlapped adds to the step.

**Links.** The group is C ranks T apart (``ParallelPlan``: data x pipeline x context x tensor), on
one node while C x T <= G. On the node every mode moves at ``allgather_gbps``: NCCL's NVLink bus
bandwidth for collectives other than all-reduce, which all-to-all, all-gather and a ring's
neighbour sends reach alike (NVIDIA/nccl-tests#212: 450 GB/s line rate, about 370 GB/s effective).
Off the node a rank's all-to-all and sends go through its own network card only (NVIDIA/nccl-tests#267:
all-to-all cannot aggregate a node's cards): ``links.inter_node_bytes_per_s`` with one rank.

**Memory** (``exchange_bytes_per_sample``, at one block, beside the activations / C): Ulysses four
copies of q, k, v and the output (a send buffer, a receive buffer and the reordered result, and in
backward the gradients of q, k and v waiting for their exchange); measured on this CPU
(tests/distributed/test_context_parallel.py): without them the predicted peak of GPT-2 tiny at C = 2
was 2.5% under the measured one. All-gather: the gathered k, v, their gradient and its copy for the
reduce-scatter, and the mask (its boolean and its additive form). Ring, in backward, its largest
moment: three k/v blocks (in use, arriving, the send copy), the fp32 gradients of q, k and v, and
two fp32 k/v gradient blocks in flight (torch's ``_templated_ring_attention_backward``).

Not modelled: the all-gather form's masked kernel may run below the fused causal kernel's rate (its
doubled work is counted, its rate is the attention rate); a ring step's kernel on short blocks runs
below the rate of one long attention.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import get_args

from elixir_tune.plan.schema import DTYPE_BYTES, ContextMode
from elixir_tune.profiler.schema import ActivationLine, ModelProfile

MODES: tuple[str, ...] = get_args(ContextMode)
# Ulysses: exchanges per block in one forward (q, k and v before attention, its output after).
FORWARD_ALL_TO_ALLS = 4
# Ulysses: copies of the exchanged q, k, v and output alive at once per rank sample (see the docstring).
EXCHANGE_COPIES = 4
# Ulysses: device copies of each exchanged tensor (send rows made contiguous, received rows permuted).
ULYSSES_COPIES = 2
# All-gather: forward collectives per block (k and v gathered apart), backward (their reduce-scatters).
ALLGATHER_COLLECTIVES = 2
# All-gather: full-sequence k/v copies alive at one block (gathered, its gradient, the gradient's copy).
ALLGATHER_KV_COPIES = 3
# Ring: k/v blocks alive at once (the one in use, the one arriving, the concatenated send copy).
RING_KV_BLOCKS = 3
# Ring: fp32 k/v gradient blocks in flight in backward (arriving, the concatenated send copy).
RING_GRAD_BLOCKS = 2
# Ring gradients and merged outputs are accumulated in fp32 (torch's _cp_options.convert_to_f32).
FP32_BYTES = 4
# Ring: bytes per score element alive at once in backward. The engine's ring computes attention in
# eager form (engine/parallel/ring_attention.py: no kernel returns the log-sum-exp it merges by), and
# its backward differentiates one key block against all the rank's queries in one autograd call:
# the fp32 probabilities autograd saves, their gradient and the scores' gradient (3 x 4 bytes).
RING_SCORE_BYTES = 12
# A forward+backward's attention FLOPs are three times its forward's (the cost model's convention).
BACKWARD_OVER_FORWARD = 2.0


@dataclass(frozen=True)
class ContextWidths:
    """What one rank of a context group exchanges, per token and element.

    Attributes:
        degree: context degree C.
        mode: ``ulysses``, ``allgather`` or ``ring``.
        seq_len: S, the whole sequence.
        q_width: elements of q (and of the output) per token on the rank (h / T).
        kv_width: elements of k (and of v) per token on the rank (h x kv heads / heads / T).
        element_bytes: bytes per element of the compute dtype.
        heads: attention heads on the rank (heads / T).
    """

    degree: int
    mode: str
    seq_len: int
    q_width: float
    kv_width: float
    element_bytes: int
    heads: float = 1.0

    @classmethod
    def of(cls, profile: ModelProfile, degree: int, mode: str, dtype: str, tensor: int = 1) -> ContextWidths:
        """The widths of a (whole-model) profile's attention at context degree C and tensor degree T."""
        arch = profile.arch
        kv_fraction = (arch.num_kv_heads or arch.num_heads) / max(arch.num_heads, 1)
        q_width = arch.hidden_size / max(tensor, 1)
        heads = max(arch.num_heads, 1) / max(tensor, 1)
        return cls(degree, mode, profile.seq_len, q_width, q_width * kv_fraction, DTYPE_BYTES[dtype], heads)

    @property
    def local_tokens(self) -> int:
        """The rank's tokens of one sample, S / C."""
        return self.seq_len // self.degree

    def kv_block_bytes(self, tokens: float) -> float:
        """k and v of ``tokens`` tokens."""
        return tokens * 2 * self.kv_width * self.element_bytes


def exchange_bytes_per_sample(widths: ContextWidths) -> int:
    """Device bytes the exchange adds at one attention block, per sample of the rank (see the module
    docstring, Memory); 0 at C = 1."""
    if widths.degree <= 1:
        return 0
    n, e = widths.local_tokens, widths.element_bytes
    if widths.mode == "allgather":
        whole_kv = widths.kv_block_bytes(widths.seq_len)
        mask = n * widths.seq_len * (e + 1)  # the boolean and the additive mask
        return int(ALLGATHER_KV_COPIES * whole_kv + mask)
    if widths.mode == "ring":
        grads = n * (widths.q_width + 2 * widths.kv_width) * FP32_BYTES
        in_flight = RING_GRAD_BLOCKS * widths.kv_block_bytes(n) * FP32_BYTES / e
        scores = RING_SCORE_BYTES * widths.heads * n * n  # the rank's queries x one key block
        return int(RING_KV_BLOCKS * widths.kv_block_bytes(n) + grads + in_flight + scores)
    return int(EXCHANGE_COPIES * n * (2 * widths.q_width + 2 * widths.kv_width) * e)


def held_bytes_per_sample(widths: ContextWidths) -> int:
    """Bytes each attention block that is not recomputed keeps for backward beyond its 1/C of the
    activations, per sample: the all-gather form's other ranks' k and v and its mask; 0 otherwise."""
    if widths.degree <= 1 or widths.mode != "allgather":
        return 0
    n = widths.local_tokens
    others_kv = widths.kv_block_bytes(widths.seq_len - n)
    return int(others_kv + n * widths.seq_len * widths.element_bytes)


def context_share(
    profile: ModelProfile, degree: int, mode: str = "ulysses", dtype: str = "", tensor: int = 1
) -> ModelProfile:
    """What one rank of a context group of ``degree`` computes and keeps, as a profile: every
    per-sample figure divided by C, ``seq_len`` the rank's S / C, the exchange's buffers (and the
    all-gather form's kept k, v and mask) added to the activations (``profile`` itself at C = 1).

    Args:
        profile: the rank's profile without context parallelism (``stage_profile.rank_profile``).
        degree: context degree C.
        mode: ``ulysses``, ``allgather`` or ``ring``.
        dtype: the compute dtype (default: the profile's).
        tensor: tensor degree T (q, k and v are 1/T as wide on the rank).
    """
    if degree <= 1:
        return profile
    widths = ContextWidths.of(profile, degree, mode, dtype or profile.dtype, tensor)
    exchange = exchange_bytes_per_sample(widths)
    held = held_bytes_per_sample(widths)
    attention_blocks = len(profile.blocks) if profile.arch.num_heads else 0

    def line(activation: ActivationLine | None, held_blocks: int) -> ActivationLine | None:
        if activation is None:
            return None
        return ActivationLine(
            activation.fixed_bytes, activation.per_sample_bytes // degree + exchange + held * held_blocks
        )

    blocks = [
        replace(
            block,
            fwd_flops_per_sample=block.fwd_flops_per_sample / degree,
            activation_bytes_per_sample=block.activation_bytes_per_sample // degree + held,
            boundary_bytes_per_sample=block.boundary_bytes_per_sample // degree,
            dropout_scores_per_sample=block.dropout_scores_per_sample // degree,
        )
        for block in profile.blocks
    ]
    activation = line(profile.activation, attention_blocks)
    assert activation is not None
    return replace(
        profile,
        seq_len=max(1, profile.seq_len // degree),
        blocks=blocks,
        flops_per_sample=profile.flops_per_sample / degree,
        recompute_flops_per_sample=profile.recompute_flops_per_sample / degree,
        pointwise_bytes_per_sample=profile.pointwise_bytes_per_sample / degree,
        recompute_pointwise_bytes_per_sample=profile.recompute_pointwise_bytes_per_sample / degree,
        prologue_bytes_per_sample=profile.prologue_bytes_per_sample // degree,
        activation=activation,
        # Checkpointed: one block's forward is recomputed at a time, so one block holds the kept bytes.
        activation_checkpointed=line(profile.activation_checkpointed, min(1, attention_blocks)),
        selective=None,  # traced for the whole sequence; selective runs without context parallelism (capabilities)
    )


@dataclass(frozen=True)
class ExchangeRates:
    """The rates an exchange runs at.

    Attributes:
        link_bytes_per_s: bytes per second each rank sends at on the group's link (``module docstring``, Links).
        latency_s: fixed cost of one collective or send.
        copy_bytes_per_s: device memory copy rate (bytes read + written per second, ``hbm_gbps``).
        overlaps: sends run beside the compute (a GPU's copy engines; False on a CPU device, whose
            gloo sends run on the compute cores).
    """

    link_bytes_per_s: float
    latency_s: float
    copy_bytes_per_s: float
    overlaps: bool = True


@dataclass(frozen=True)
class ExchangeTime:
    """Seconds one micro-batch's context exchange adds on one rank.

    Attributes:
        forward_s: one attention block's forward exchange (exposed part).
        backward_s: one block's backward exchange (exposed part).
        attention_extra_s: one block's attention compute beyond the causal share (all-gather form:
            the masked half), forward and backward.
    """

    forward_s: float
    backward_s: float
    attention_extra_s: float = 0.0

    def step_s(self, blocks: int, recomputed_blocks: int) -> float:
        """Exchange and extra attention of ``blocks`` blocks, ``recomputed_blocks`` of which run their
        forward again in backward."""
        forward = self.forward_s + self.attention_extra_s / (1 + BACKWARD_OVER_FORWARD)
        whole = self.forward_s + self.backward_s + self.attention_extra_s
        return blocks * whole + recomputed_blocks * forward


def context_exchange(
    widths: ContextWidths, micro_batch_size: int, attention_forward_s: float, rates: ExchangeRates
) -> ExchangeTime:
    """The exchange of one attention block for one micro-batch (module docstring, Exchange).

    Args:
        widths: the group and its widths.
        micro_batch_size: samples per micro-batch.
        attention_forward_s: the rank's attention compute of one block's forward (its 1/C causal
            share), which a ring's sends overlap.
        rates: links and copy rate.

    Returns:
        The exposed seconds, 0 at C = 1.
    """
    degree = widths.degree
    if degree <= 1:
        return ExchangeTime(0.0, 0.0)
    tokens = micro_batch_size * widths.local_tokens
    link, latency, copy = rates.link_bytes_per_s, rates.latency_s, rates.copy_bytes_per_s
    e = widths.element_bytes
    if widths.mode == "allgather":
        gathered = (degree - 1) * widths.kv_block_bytes(tokens)
        # The gathered rows permuted into sequence order (forward), the gradient copied for the reduce-scatter.
        one_way = ALLGATHER_COLLECTIVES * latency + gathered / link + 2 * degree * widths.kv_block_bytes(tokens) / copy
        mask_s = tokens * widths.seq_len * (1 + 2 * e) / copy  # built per call: the boolean, zeros, the fill
        extra = attention_forward_s * (1 + BACKWARD_OVER_FORWARD)
        return ExchangeTime(one_way + mask_s, one_way, extra)
    if widths.mode == "ring":
        return _ring(widths, tokens, attention_forward_s, rates)
    exchanged = tokens * (2 * widths.q_width + 2 * widths.kv_width) * e
    one_way = FORWARD_ALL_TO_ALLS * latency + (degree - 1) / degree * exchanged / link
    one_way += ULYSSES_COPIES * 2 * exchanged / copy
    return ExchangeTime(one_way, one_way)


def _ring(widths: ContextWidths, tokens: int, attention_forward_s: float, rates: ExchangeRates) -> ExchangeTime:
    """``context_exchange`` of the ring: per step max(compute, send) where sends overlap, both otherwise."""
    steps = widths.degree
    link, latency, copy = rates.link_bytes_per_s, rates.latency_s, rates.copy_bytes_per_s
    kv = widths.kv_block_bytes(tokens)
    grad_kv = kv * FP32_BYTES / widths.element_bytes
    q_elements = tokens * widths.q_width
    forward_step_s = attention_forward_s / steps
    backward_step_s = forward_step_s * BACKWARD_OVER_FORWARD
    forward_send_s = latency + kv / link
    backward_send_s = latency + (kv + grad_kv) / link
    if rates.overlaps:
        forward = (steps - 1) * max(0.0, forward_send_s - forward_step_s)
        backward = (steps - 1) * max(0.0, backward_send_s - backward_step_s) + latency + grad_kv / link
    else:
        forward = (steps - 1) * forward_send_s
        backward = (steps - 1) * backward_send_s + latency + grad_kv / link
    # On the device per step: the block concatenated for its send; forward the fp32 merge of the
    # output (read it and the block's output, write it), backward the fp32 accumulation of q's, k's
    # and v's gradients and the gradient block's concatenation.
    e = widths.element_bytes
    forward += (steps - 1) * (2 * kv + q_elements * (2 * FP32_BYTES + e)) / copy
    accumulate = (q_elements + 2 * tokens * widths.kv_width) * (2 * FP32_BYTES + e)
    backward += (steps - 1) * (2 * kv + accumulate + 2 * grad_kv) / copy
    return ExchangeTime(forward, backward)
