"""The block rate over the tokens of a micro-batch: tile and wave quantization (issue 38)."""

from __future__ import annotations

import pytest

from elixir_tune.costmodel.gemm_waves import (
    REFERENCE_TOKENS,
    block_efficiency,
    block_gemms,
    micro_batch_rate_factor,
    wave_efficiency,
)
from elixir_tune.costmodel.model import CostModel
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware


def test_wave_efficiency_counts_the_last_wave_at_the_best_tile():
    # 2048 x 2304 on 108 SMs: 128x256 -> 16 x 9 = 144 tiles, 2 waves (0.667); 256x128 -> 8 x 18 = 144, the
    # same; 128x128 -> 16 x 18 = 288 tiles, 3 waves: 288 / 324.
    assert wave_efficiency(2048, 2304, 108) == pytest.approx(288 / 324)
    # A product that fills whole waves wastes nothing.
    assert wave_efficiency(128 * 108, 256, 108) == pytest.approx(1.0)
    assert wave_efficiency(0, 10, 108) == 1.0 and wave_efficiency(10, 10, 0) == 1.0


def test_the_weight_gradient_keeps_its_shape_whatever_the_tokens():
    gemms = [(2048, 2048, 2048 * 2048)]
    # With one token row per tile the forward and input-gradient products waste most of their tiles,
    # the weight gradient (2048 x 2048 outputs) none of its own.
    low = block_efficiency(gemms, 1, 132)
    assert low < 0.05
    assert block_efficiency(gemms, REFERENCE_TOKENS, 132) > 0.95


def _mpt(hidden: int, heads: int, seq_len: int = 1024):
    return gpt2_profile(hidden=hidden, layers=2, heads=heads, vocab=1000, seq_len=seq_len, flash_attention=True)


@pytest.mark.parametrize(
    ("hidden", "heads", "tokens"),
    # The llm-foundry H100 rows the block curves were fitted to: width, heads, micro-batch x 1024 or 512.
    [(1536, 12, 96 * 512), (2048, 16, 56 * 512), (2560, 20, 40 * 512), (4096, 32, 64 * 1024), (5120, 40, 40 * 1024)]
    + [(7168, 56, 6 * 1024)],
)
@pytest.mark.parametrize("sm_count", [132, 108])
def test_the_fitted_rows_ran_within_1_3_percent_of_the_reference(hidden, heads, tokens, sm_count):
    gemms = block_gemms(_mpt(hidden, heads), 1)
    ratio = block_efficiency(gemms, tokens, sm_count) / block_efficiency(gemms, REFERENCE_TOKENS, sm_count)
    assert ratio == pytest.approx(1.0, abs=0.013)


def test_a_narrow_block_at_one_short_sample_runs_slower_per_token():
    profile = _mpt(1536, 12, seq_len=512)  # MPT-760m's width
    assert micro_batch_rate_factor(profile, 1, 1, 132) < 0.7
    assert micro_batch_rate_factor(profile, REFERENCE_TOKENS // 512, 1, 132) == pytest.approx(1.0)
    # Tensor parallelism narrows the local products: a 4-way split of the same block at 8 samples
    # wastes more than the whole block does.
    assert micro_batch_rate_factor(profile, 8, 4, 132) < micro_batch_rate_factor(profile, 8, 1, 132)


def test_the_cost_model_prices_a_small_micro_batch_on_a_gpu_and_not_on_a_cpu():
    profile = _mpt(1536, 12, seq_len=512)
    gpu = CostModel(profile, load_hardware("h100-80gb-sxm"), gpus_per_node=8)
    per_sample_small = gpu.compute_s(1, 0)[0]
    per_sample_large = gpu.compute_s(64, 0)[0] / 64
    assert per_sample_small > 1.3 * per_sample_large
    cpu = CostModel(profile, load_hardware("cpu"), gpus_per_node=1)
    assert cpu.flops_per_s_at(1) == cpu.flops_per_s_at(64)
