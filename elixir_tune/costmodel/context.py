"""Context parallelism (``parallel.context``, Ulysses) in the cost model.

A rank of a context group of C computes 1/C of every sample's tokens with the whole model's
weights: its linear layers see S / C tokens, and its attention, after the all-to-all over heads,
covers the whole sequence for H / C heads. So every per-sample figure of the profile (FLOPs,
pointwise bytes, activations, each block's bytes and dropout scores) is 1/C of the whole model's,
and the rank's tokens per micro-batch are b x S / C (``context_share``, also the profile's
``seq_len`` for the rates read per token). The chunks are sharded over data x context, which is
the cost model's ``data_size`` (world / (P x T)) unchanged.

What it adds: per block, forward the all-to-alls of q, k, v (before attention) and of its output
(after), backward the same bytes again, and a recomputed block's forward ones once more. Each rank
sends (C - 1) / C of its tensors (``ulysses_all_to_all_s``); the group is C consecutive ranks, on
one node when C <= GPUs per node. They run on the compute stream (the engine waits for them
inside attention), so they add to the step.

Memory it adds (``EXCHANGE_COPIES``): the exchange's buffers at one block, four copies of q, k, v
and the output per sample of the rank. Measured on this CPU (tests/distributed/test_context_parallel.py):
without them the predicted peak of GPT-2 tiny at C = 2 was 2.5% under the measured one; with three
copies a Llama at 4096 tokens measured 0.76-1.05x of its promise over runs (the step peak of a
context-parallel step varies by a third between identical runs on CPU; a data-parallel one does not).

Not modelled yet: the ring form (K/V around the ring overlapped with compute).
"""

from __future__ import annotations

from dataclasses import replace

from elixir_tune.plan.schema import DTYPE_BYTES
from elixir_tune.profiler.schema import ActivationLine, ModelProfile

# Exchanges per block in one forward: q, k and v before attention, its output after.
FORWARD_ALL_TO_ALLS = 4
# Copies of the exchanged q, k, v and output alive at once per rank sample: a send buffer, a receive
# buffer and the reordered result, and in backward the gradients of q, k and v, which attention's
# backward returns together and which then wait for their own exchange.
EXCHANGE_COPIES = 4


def context_share(profile: ModelProfile, degree: int) -> ModelProfile:
    """What one rank of a context group of ``degree`` computes and keeps, as a profile: every
    per-sample figure divided by C, ``seq_len`` the rank's S / C tokens (``profile`` itself at C = 1).

    Args:
        profile: the rank's profile without context parallelism (``stage_profile.rank_profile``).
        degree: context degree C.
    """
    if degree <= 1:
        return profile

    arch = profile.arch
    kv_fraction = (arch.num_kv_heads or arch.num_heads) / max(arch.num_heads, 1)
    local_tokens = profile.seq_len // degree
    exchange = EXCHANGE_COPIES * local_tokens * arch.hidden_size * (2 + 2 * kv_fraction) * DTYPE_BYTES[profile.dtype]

    def line(activation: ActivationLine | None) -> ActivationLine | None:
        if activation is None:
            return None
        return ActivationLine(activation.fixed_bytes, activation.per_sample_bytes // degree + int(exchange))

    blocks = [
        replace(
            block,
            fwd_flops_per_sample=block.fwd_flops_per_sample / degree,
            activation_bytes_per_sample=block.activation_bytes_per_sample // degree,
            boundary_bytes_per_sample=block.boundary_bytes_per_sample // degree,
            dropout_scores_per_sample=block.dropout_scores_per_sample // degree,
        )
        for block in profile.blocks
    ]
    activation = line(profile.activation)
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
        activation_checkpointed=line(profile.activation_checkpointed),
        selective=None,  # traced for the whole sequence; selective runs without context parallelism (capabilities)
    )


def ulysses_all_to_all_s(
    degree: int,
    local_tokens: int,
    hidden_size: int,
    kv_fraction: float,
    element_bytes: int,
    blocks: int,
    recomputed_blocks: int,
    *,
    link_bytes_per_s: float,
    latency_s: float,
) -> float:
    """Seconds of one micro-batch's Ulysses all-to-alls on one rank.

    Args:
        degree: context degree C (1: none).
        local_tokens: the rank's tokens of the micro-batch, b x S / C.
        hidden_size: h (q and the output are h wide per token).
        kv_fraction: key/value heads over heads (k and v are h x this wide per token).
        element_bytes: bytes per element of the compute dtype.
        blocks: attention blocks the rank runs.
        recomputed_blocks: of which recompute their forward in backward.
        link_bytes_per_s: bytes per second each rank sends at on the group's link.
        latency_s: fixed cost of one collective.
    """
    if degree <= 1 or blocks <= 0:
        return 0.0
    sent = (degree - 1) / degree * local_tokens * element_bytes / link_bytes_per_s
    forward_s = sent * hidden_size * (2 + 2 * kv_fraction) + FORWARD_ALL_TO_ALLS * latency_s
    return blocks * 2 * forward_s + recomputed_blocks * forward_s
