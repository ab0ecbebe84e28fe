"""How a block's matrix products run at the tokens of one micro-batch: tile and wave quantization.

A GPU GEMM of an (M x K) by (K x N) product is cut into output tiles of tm x tn elements, one per
thread block; the SMs run the tiles in waves of ``sm_count`` tiles, and the last wave runs partly
empty (NVIDIA, "Matrix Multiplication Background User's Guide", sections "Tile Quantization" and
"Wave Quantization", docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication).
The work done is that of ceil(T / S) full waves of S tiles, T = ceil(M / tm) x ceil(N / tn), so the
share of it that is useful is

    e(M, N) = M x N / (ceil(T / S) x S x tm x tn).

This is what makes the micro-batch size matter: a block's forward products and the backward's
input-gradient products have M = micro-batch x sequence rows, so few tokens leave a last wave
half idle, while the weight-gradient products reduce over M and keep their shape. The cost model
reads the block rate of its curve (fitted to runs of 6144-65536 tokens per micro-batch) as the
rate at ``REFERENCE_TOKENS`` tokens and scales it by e at the plan's tokens over e there.

What this leaves out, stated: the library picks among more tiles than ``GEMM_TILES`` (split-K,
stream-K and smaller tiles for small products), so the loss it computes is the largest a
fixed-tile library would pay among these tiles, taking the best of them; per-kernel launch time and
the attention kernel's own grid (batch x heads x query tiles) are not in it.
"""

from __future__ import annotations

import math

from elixir_tune.profiler.schema import ModelProfile

# Output tiles (rows x columns) of the bf16/fp16 tensor-core GEMMs the presets' GPUs run. Source:
# assumption from CUTLASS's default threadblock shapes for large half-precision GEMMs (128x256 and
# 256x128 on SM80 and SM90, 128x128 as the common smaller one); the library is taken to pick the
# one of these that wastes least.
GEMM_TILES: tuple[tuple[int, int], ...] = ((128, 256), (256, 128), (128, 128))

# Tokens per micro-batch at which a preset's block curve is read as measured. Source: the
# llm-foundry rows the GPU presets' curves were fitted to ran 6144 (MPT-30b, 6 x 1024) to 65536
# (MPT-7b, 64 x 1024) tokens per micro-batch (configs/hardware/h100-80gb-sxm.yaml's header, micro-batches
# from its source table); 65536 stands for them: at each fitted row's own width and tokens, the block's
# e is within 1.3% of e(65536) on 132 and on 108 SMs (tests/unit/test_gemm_waves.py).
REFERENCE_TOKENS = 65536


def wave_efficiency(rows: int, cols: int, sm_count: int) -> float:
    """The useful share of the work one GEMM of ``rows`` x ``cols`` outputs runs, at the best tile.

    Args:
        rows: output rows (M).
        cols: output columns (N).
        sm_count: streaming multiprocessors (tiles per wave).

    Returns:
        A share in (0, 1]; 1.0 when any input is not positive.
    """
    if rows <= 0 or cols <= 0 or sm_count <= 0:
        return 1.0
    best = 0.0
    for tile_rows, tile_cols in GEMM_TILES:
        tiles = math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols)
        waves = math.ceil(tiles / sm_count)
        best = max(best, rows * cols / (waves * sm_count * tile_rows * tile_cols))
    return best


def block_gemms(profile: ModelProfile, tensor: int) -> list[tuple[int, int, int]]:
    """One block's matrix products at tensor-local shapes, as (K, N, FLOP weight K x N).

    The attention's query/key/value projection (h -> h + 2 x kv heads x head width), its output
    projection (h -> h), and the MLP's two products (h -> f, f -> h; a gated MLP's two inner
    products counted as one of 2f). Column-parallel products split N by ``tensor``, row-parallel
    ones K. Empty when the profile has no architecture numbers.
    """
    arch = profile.arch
    hidden = arch.hidden_size
    if hidden <= 0 or arch.num_heads <= 0:
        return []
    tensor = max(1, tensor)
    head = hidden // arch.num_heads
    qkv = hidden + 2 * (arch.num_kv_heads or arch.num_heads) * head
    inner = arch.intermediate_size or 4 * hidden
    gated = arch.model_type not in ("", "gpt2", "gpt_neox", "opt", "bloom", "falcon", "gptj", "phi", "mpt")
    up = 2 * inner if gated else inner
    shapes = [(hidden, qkv // tensor), (hidden // tensor, hidden), (hidden, up // tensor), (inner // tensor, hidden)]
    return [(k, n, k * n) for k, n in shapes]


def block_efficiency(gemms: list[tuple[int, int, int]], tokens: int, sm_count: int) -> float:
    """The useful share of a block's forward+backward GEMM work at ``tokens`` rows per product.

    Each product (K x N weight) runs three times with equal FLOPs: forward (tokens x N outputs),
    input gradient (tokens x K) and weight gradient (K x N, reduced over the tokens). Their times add,
    so the share is the FLOP-weighted harmonic mean.

    Args:
        gemms: ``block_gemms``.
        tokens: rows of the forward products (micro-batch x sequence).
        sm_count: streaming multiprocessors (0: no wave model, 1.0).
    """
    if not gemms or sm_count <= 0 or tokens <= 0:
        return 1.0
    flops = 0.0
    work = 0.0
    for k, n, weight in gemms:
        for rows, cols in ((tokens, n), (tokens, k), (k, n)):
            flops += weight
            work += weight / wave_efficiency(rows, cols, sm_count)
    return flops / work


def micro_batch_rate_factor(profile: ModelProfile, micro_batch_size: int, tensor: int, sm_count: int) -> float:
    """The block rate at ``micro_batch_size`` samples over the curve's (read at ``REFERENCE_TOKENS``).

    Args:
        profile: the rank's profile (its architecture and sequence length).
        micro_batch_size: samples per micro-batch.
        tensor: the tensor-parallel degree (local GEMM widths).
        sm_count: the GPU's streaming multiprocessors (0: 1.0, no wave model, e.g. a CPU).
    """
    gemms = block_gemms(profile, tensor)
    if not gemms or sm_count <= 0:
        return 1.0
    tokens = micro_batch_size * profile.seq_len
    return block_efficiency(gemms, tokens, sm_count) / block_efficiency(gemms, REFERENCE_TOKENS, sm_count)
