"""Micro-benchmarks of one device: dense matmul rate, memory copy bandwidth, Adam update rate.

Each works on ``cuda`` and ``cpu`` alike; the caller sets the CPU thread count (the threads one
rank gets) before calling.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from elixir_tune.dtypes import TORCH_DTYPES
from elixir_tune.hardware.timing import median_time_s

# tf32 is fp32 storage with TF32 matmuls (switched on around the benchmark).
DTYPES = {**TORCH_DTYPES, "tf32": torch.float32}


def transformer_gemms(tokens: int, hidden: int) -> list[tuple[int, int, int]]:
    """The (tokens, in, out) shapes of one transformer block's linear layers.

    QKV projection, attention output, MLP up (4x) and MLP down, as F.linear computes them.
    """
    return [
        (tokens, hidden, 3 * hidden),
        (tokens, hidden, hidden),
        (tokens, hidden, 4 * hidden),
        (tokens, 4 * hidden, hidden),
    ]


def matmul_tflops(device: torch.device, dtype_name: str, tokens: int, hidden: int, budget_s: float) -> float:
    """Dense matmul rate reached on one transformer block's linear layers.

    Args:
        device: where to run.
        dtype_name: fp32, tf32 (fp32 with TF32 tensor cores allowed, CUDA only), bf16 or fp16.
        tokens: rows of the activation (micro-batch x sequence length).
        hidden: model width.
        budget_s: time to spend in all.

    Returns:
        Total FLOPs of the block's GEMMs divided by their total median time, in TFLOP/s.
    """
    dtype = DTYPES[dtype_name]
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype_name == "tf32"
    try:
        flops, seconds = 0.0, 0.0
        shapes = transformer_gemms(tokens, hidden)
        for rows, fan_in, fan_out in shapes:
            x = torch.randn(rows, fan_in, device=device, dtype=dtype)
            weight = torch.randn(fan_out, fan_in, device=device, dtype=dtype)
            seconds += median_time_s(
                functools.partial(F.linear, x, weight),
                device,
                budget_s / len(shapes),
                warmup=2 if device.type == "cuda" else 1,
            )
            flops += 2.0 * rows * fan_in * fan_out
            del x, weight
        return flops / seconds / 1e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32


def copy_gbps(device: torch.device, num_bytes: int, budget_s: float) -> float:
    """Memory copy bandwidth of ``device``: bytes read plus bytes written per second, in GB/s.

    The read+write convention is that of CUDA's bandwidthTest device-to-device figure, so it is
    comparable with a datasheet's memory bandwidth.
    """
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = median_time_s(lambda: dst.copy_(src), device, budget_s, warmup=2)
    return 2 * num_bytes / seconds / 1e9


def _adamw(params: list[torch.Tensor], device: torch.device) -> tuple[torch.optim.Optimizer, str]:
    """Fused AdamW where this torch has it for the device, else the foreach implementation."""
    try:
        optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
        optimizer.step()
        return optimizer, "fused"
    except (RuntimeError, ValueError, TypeError):
        for param in params:
            param.grad = torch.full_like(param, 1e-3)
        return torch.optim.AdamW(params, lr=1e-3, foreach=True), "foreach"


def adam_elems_per_s(device: torch.device, num_elements: int, budget_s: float) -> tuple[float, str]:
    """AdamW update rate over fp32 master shards, as the engine's optimizer steps them.

    Args:
        device: where the states live and the update runs.
        num_elements: elements updated per step (split over two flat tensors, like chunk shards).
        budget_s: time to spend.

    Returns:
        (elements per second, implementation used: "fused" or "foreach").
    """
    half = num_elements // 2
    params = [torch.zeros(n, device=device, requires_grad=True) for n in (half, num_elements - half)]
    for param in params:
        param.grad = torch.full_like(param, 1e-3)  # the rate does not depend on the values
    optimizer, impl = _adamw(params, device)
    seconds = median_time_s(optimizer.step, device, budget_s, warmup=1)
    return num_elements / seconds, impl
