"""Compute rates that depend on the model's shapes, and the plausibility bound on a step.

The rates are useful-FLOP rates: the FLOPs a model needs (6 x parameters x tokens plus the
attention products, recomputation not counted) per second of the work that delivers them.
Recomputation is extra work at the same rates over ``recompute_speedup`` (``CostModel.compute_s``):
block rates fitted to llm-foundry's checkpointed rows predict its uncheckpointed micro-batch sweep's
time per sample only when a recomputed forward runs 1.45x faster per FLOP than the forward+backward mean
(``scripts/published_overlap_fit.py``).

Two parts of a transformer run at different rates. Its matrix products (projections, MLP, head)
run at the block rate, read from a curve over the block's parameter count (wide blocks keep the
tensor cores busier); the attention products run at the attention rate, whose share of the FLOPs
grows with the sequence length (4 x seq^2 x hidden per layer forward against ~24 x hidden^2 x seq
for the rest). So a narrow model or a long sequence runs below the rate of a wide model at 2K. The attention
rate is a fused kernel's (the presets fit it to FlashAttention runs); an eager attention, which
writes its seq x seq scores, also moves them through HBM (``attention_scores_bytes``).

The plausibility bound says how fast a step can be at all: its useful FLOPs at the best MFU
published for the hardware class (plus an eager attention's score traffic, which the fused
attention of the published runs did not pay), its offloaded shards over the host link, its host Adam at the
node's rate. The bound is a check, not a clamp: a prediction below it stays as predicted and its
breakdown says by how much it beats the bound (``bound_*_s`` entries, ``bound_excess_s``), a defect of
the model that ``show`` reports and the published table's checks count.
"""

from __future__ import annotations

from elixir_tune.hardware.spec import HardwareSpec
from elixir_tune.plan.schema import DTYPE_BYTES
from elixir_tune.profiler.schema import ModelProfile

# Names of the bounds in a step's breakdown, in the order ``show`` lists them.
BOUND_KEYS = ("bound_compute_s", "bound_pcie_s", "bound_cpu_adam_s")
BOUND_LABELS = {
    "bound_compute_s": "compute at the best published MFU",
    "bound_pcie_s": "offloaded shards over PCIe",
    "bound_cpu_adam_s": "host Adam at the node's rate",
}


def attention_flops_share(profile: ModelProfile) -> float:
    """The part of a sample's forward+backward FLOPs that the attention products are.

    4 x seq^2 x hidden FLOPs per layer forward (QK^T and AV over all heads, non-causal as MFU
    tables count them), three times that for forward+backward; 0 when the profile has no
    architecture numbers (a custom model) or no FLOPs.
    """
    arch = profile.arch
    if not profile.flops_per_sample or arch.num_layers <= 0 or arch.hidden_size <= 0:
        return 0.0
    attention = 3 * arch.num_layers * 4 * profile.seq_len**2 * arch.hidden_size
    return min(1.0, attention / profile.flops_per_sample)


def attention_scores_bytes(profile: ModelProfile, dtype: str, dropout_counted: bool = False) -> tuple[float, float]:
    """HBM bytes one sample's attention scores move when the attention writes them to memory.

    The attention rate (``attention_tflops``) is a fused kernel's: FlashAttention keeps the
    seq x seq scores on chip. An eager attention (``arch.attention_scores``: GPT-2's and Megatron's
    2021 attention, transformers' ``eager``) writes them and reads them back through a chain of
    memory-bound kernels, per element of heads x seq^2 per layer (b bytes per element of the
    compute dtype, 1 for the dropout mask): forward, scores written by QK^T (b), softmax read and
    written (2b), dropout read and written plus its mask (2b + 1), read by the product with V (b):
    6b + 1; backward, the dropped probabilities read for dV (b), their gradient written (b),
    dropout's backward (2b + 1), softmax's backward reading the gradient and the probabilities and
    writing the scores' gradient (3b), that read for dQ and for dK (2b): 9b + 1.

    A traced profile's pointwise bytes (``elixir_tune.pointwise``) already hold the dropout's
    multiplications (and the masking and scaling ops this count leaves out); when those bytes are
    priced (``dropout_counted``), the dropout's 2b + 1 leaves each direction: 4b and 7b.

    Args:
        profile: the whole model's profile (heads, layers and sequence from its architecture).
        dtype: compute dtype.
        dropout_counted: the profile's priced pointwise bytes include the dropout on the scores.

    Returns:
        (forward, backward) bytes of one sample over all layers; (0, 0) when the profile's attention
        is fused or unknown.
    """
    arch = profile.arch
    if not arch.attention_scores or arch.num_layers <= 0 or arch.num_heads <= 0:
        return 0.0, 0.0
    elements = arch.num_layers * arch.num_heads * profile.seq_len**2
    width = DTYPE_BYTES.get(dtype, 4)
    if dropout_counted:
        return float(elements * 4 * width), float(elements * 7 * width)
    return float(elements * (6 * width + 1)), float(elements * (9 * width + 1))


def plausibility_bound(
    hardware: HardwareSpec,
    dtype: str,
    useful_flops_per_gpu: float,
    offloaded_numel_per_rank: int,
    ranks_on_node: int,
    world_size: int,
    offloaded_trainable_numel_per_rank: int | None = None,
    scores_s: float = 0.0,
) -> dict[str, float]:
    """The least time a step can take, per bound (0 where a bound does not apply).

    Args:
        hardware: the node spec.
        dtype: compute dtype.
        useful_flops_per_gpu: the step's model FLOPs on one GPU (recomputation not counted).
        offloaded_numel_per_rank: shard elements of one rank that live on the host.
        ranks_on_node: ranks sharing the node's host.
        world_size: ranks in all (one rank copies alone at the single-GPU bandwidth).
        offloaded_trainable_numel_per_rank: the trainable part of them (None: all); frozen shards (a
            LoRA base) go up only, with no gradient down and no host Adam.
        scores_s: an eager attention's score traffic in the step (``attention_scores_bytes`` at the
            HBM rate): the best MFU was published with fused attention, so it adds to the compute bound.

    Returns:
        ``bound_compute_s``: the FLOPs at ``best_mfu`` x the datasheet peak, plus ``scores_s``
        (0 without a best MFU or a peak);
        ``bound_pcie_s``: the offloaded parameters up and the trainable ones' gradients down, each
        direction once per step in the compute dtype (0 on a CPU device, whose host and device are one pool);
        ``bound_cpu_adam_s``: the node's offloaded trainable elements at its host Adam rate.
    """
    bounds = dict.fromkeys(BOUND_KEYS, 0.0)
    best = hardware.best_mfu.get(dtype, 0.0)
    peak_tflops = hardware.matmul_peak_tflops.get(dtype, 0.0)
    if best > 0 and peak_tflops > 0:
        bounds["bound_compute_s"] = useful_flops_per_gpu / (best * peak_tflops * 1e12) + scores_s
    if offloaded_numel_per_rank > 0 and hardware.device != "cpu":
        shared = world_size > 1
        h2d = hardware.h2d_gbps_all if shared else hardware.h2d_gbps
        d2h = hardware.d2h_gbps_all if shared else hardware.d2h_gbps
        trainable = (
            offloaded_numel_per_rank
            if offloaded_trainable_numel_per_rank is None
            else offloaded_trainable_numel_per_rank
        )
        dtype_bytes = DTYPE_BYTES.get(dtype, 4)
        up_s = offloaded_numel_per_rank * dtype_bytes / (h2d * 1e9)
        down_s = trainable * dtype_bytes / (d2h * 1e9)
        bounds["bound_pcie_s"] = max(up_s, down_s)
        node_rate = hardware.cpu_adam_node_elems_per_s or hardware.cpu_adam_elems_per_s * hardware.gpus_per_node
        bounds["bound_cpu_adam_s"] = trainable * ranks_on_node / node_rate
    return bounds


def binding_bound(breakdown: dict[str, float]) -> tuple[str, float] | None:
    """The largest bound of a step's breakdown and its seconds (None when it records none)."""
    present = [(key, breakdown[key]) for key in BOUND_KEYS if breakdown.get(key, 0.0) > 0]
    return max(present, key=lambda item: item[1]) if present else None


def pointwise_beyond_rate(profile: ModelProfile, hardware: HardwareSpec, dtype: str) -> float:
    """The share of a model's pointwise bytes that its compute rate does not already pay for.

    A preset's rate was fitted to whole-model runs (llm-foundry's MPT), whose own pointwise ops
    (``hardware.rate_pointwise_elems`` elements per layer, token and hidden unit) ran inside the
    measured time; a model written with more of them (transformers' GPT-2: its GELU as eight ops,
    dropout, bias adds, the masking and scaling of its scores) pays for the rest at
    ``pointwise_gbps``. A probed rate is net of the probe block's pointwise ops (the field is 0):
    every byte is priced.

    Args:
        profile: the whole model's profile (its pointwise bytes and architecture).
        hardware: the node spec.
        dtype: compute dtype (the bytes of an element).

    Returns:
        A share in [0, 1]; 0 without a pointwise rate or without counted pointwise bytes.
    """
    total = profile.pointwise_bytes_per_sample
    if hardware.pointwise_gbps <= 0 or total <= 0:
        return 0.0
    arch = profile.arch
    included = (
        hardware.rate_pointwise_elems
        * DTYPE_BYTES.get(dtype, 4)
        * profile.seq_len
        * max(arch.num_layers, 0)
        * max(arch.hidden_size, 0)
    )
    return max(0.0, 1.0 - included / total)
