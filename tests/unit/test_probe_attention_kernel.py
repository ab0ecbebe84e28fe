"""Whether the probe block's attention ran a fused kernel (hardware/bench_compute.py): what a probed GPU
file's ``rate_fused_attention`` is set from (hardware/probe_cuda.py)."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from elixir_tune.hardware.bench_compute import block_attention_fused, is_fused_attention


def test_the_fused_kernels_are_told_from_the_math_fallback():
    assert is_fused_attention({"aten._scaled_dot_product_flash_attention", "aten.add"})
    assert is_fused_attention({"aten._scaled_dot_product_efficient_attention_backward"})
    assert is_fused_attention({"_scaled_dot_product_cudnn_attention"})
    assert not is_fused_attention({"aten._scaled_dot_product_attention_math", "aten.bmm", "aten._softmax"})
    assert not is_fused_attention(set())


def test_the_block_reports_the_kernel_it_really_ran():
    cpu, shape = torch.device("cpu"), (1, 16, 32, 2)
    # On this CPU SDPA runs its flash kernel for the block ...
    assert block_attention_fused(cpu, "fp32", shape)
    # ... and the eager products when only the math backend is allowed: the probe reads what ran.
    with sdpa_kernel(SDPBackend.MATH):
        assert not block_attention_fused(cpu, "fp32", shape)
