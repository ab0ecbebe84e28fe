"""Micro-benchmarks of one device: dense matmul rate, memory copy bandwidth, Adam update rate, a
transformer block's forward+backward and the rate of memory-bound pointwise ops.

Each works on ``cuda`` and ``cpu`` alike; the caller sets the CPU thread count (the threads one
rank gets) before calling.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from elixir_tune.dtypes import TORCH_DTYPES
from elixir_tune.hardware.timing import median_time_s
from elixir_tune.pointwise import PointwiseCounter

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


class ProbeBlock(torch.nn.Module):
    """A GPT-2 block (pre-norm attention and GELU MLP) from plain torch modules: what the block
    rate measures, without depending on transformers."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln_2 = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(hidden, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.down(F.gelu(self.up(self.ln_2(x)), approximate="tanh"))


def block_time(
    device: torch.device, dtype_name: str, batch: int, seq: int, hidden: int, heads: int, budget_s: float
) -> tuple[int, float, float, float]:
    """One transformer block's forward+backward: the measure of the model-level compute rate.

    A whole model runs below its GEMMs' rate: attention, norms, activations and per-op launch or
    dispatch overhead add time that the matmul rate ignores (on a small CPU model most of it). The
    FLOPs are counted by torch.utils.flop_counter, as the profiler counts a model's, so a rate from
    them times profiled FLOPs is a time.

    Args:
        device: where to run.
        dtype_name: fp32, bf16 or fp16 (parameters and activations in that dtype).
        batch, seq, hidden, heads: the block's input shape and attention heads.
        budget_s: time to spend.

    Returns:
        (the block's parameter count, forward+backward FLOPs of one call, bytes its pointwise ops
        write in one call, median seconds of one call).
    """
    from torch.utils.flop_counter import FlopCounterMode

    dtype = DTYPES[dtype_name]
    block = ProbeBlock(hidden, heads).to(device=device, dtype=dtype)
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype, requires_grad=True)

    def step() -> None:
        block(x).sum().backward()

    with FlopCounterMode(display=False) as counter, PointwiseCounter() as pointwise:
        step()
    seconds = median_time_s(step, device, budget_s, warmup=2)
    numel = sum(p.numel() for p in block.parameters())
    return numel, float(counter.get_total_flops()), float(pointwise.bytes), seconds


# The aten ops of scaled_dot_product_attention's kernels that never write the seq x seq scores: flash,
# memory-efficient and cuDNN on a GPU, the flash kernel on a CPU; ``_math`` is the eager fallback.
FUSED_ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


def is_fused_attention(op_names: set[str]) -> bool:
    """Whether ops dispatched by an attention include a fused kernel (``FUSED_ATTENTION_OPS``; names as
    ``aten._scaled_dot_product_flash_attention`` or without the namespace)."""
    return any(name.rpartition(".")[2].startswith(FUSED_ATTENTION_OPS) for name in op_names)


class _OpNames(TorchDispatchMode):
    """Records the name of every aten op run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def block_attention_fused(device: torch.device, dtype_name: str, shape: tuple[int, int, int, int]) -> bool:
    """Whether the probe block's attention (``ProbeBlock``: ``scaled_dot_product_attention``) ran a fused
    kernel on this device, dtype and shape (batch, seq, hidden, heads): one forward+backward with the
    dispatched ops recorded. The kernel SDPA picks depends on all three, so this is what the block rate
    really measured.
    """
    batch, seq, hidden, heads = shape
    dtype = DTYPES[dtype_name]
    block = ProbeBlock(hidden, heads).to(device=device, dtype=dtype)
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype, requires_grad=True)
    with _OpNames() as recorder:
        block(x).sum().backward()
    return is_fused_attention(recorder.names)


def tanh_gelu_unfused(x: torch.Tensor) -> torch.Tensor:
    """The tanh-approximate GELU written out op by op, as transformers' GPT-2 ("gelu_new") has it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def pointwise_gbps(device: torch.device, dtype_name: str, numel: int, budget_s: float) -> float:
    """Rate of memory-bound pointwise work: bytes written per second (``elixir_tune.pointwise``).

    Measured on an unfused tanh-GELU's forward+backward over ``numel`` elements: a chain of the
    small elementwise ops that models written op by op run (about 20 of them, each reading and
    writing the whole tensor).

    Args:
        device: where to run.
        dtype_name: fp32, bf16 or fp16.
        numel: elements of the activation (a block's MLP activation is the typical size).
        budget_s: time to spend.

    Returns:
        GB/s of pointwise output bytes.
    """
    dtype = DTYPES[dtype_name]
    x = torch.randn(numel, device=device, dtype=dtype, requires_grad=True)
    grad = torch.ones_like(x)

    def step() -> None:
        tanh_gelu_unfused(x).backward(grad)
        x.grad = None

    with PointwiseCounter() as counter:
        step()
    return counter.bytes / median_time_s(step, device, budget_s, warmup=2) / 1e9


# (batch, heads, seq, head dim) of the attention timed with and without dropout: a small GPT-2's.
DROPOUT_ATTENTION_SHAPE = (2, 4, 256, 32)
DROPOUT_P = 0.1


def dropout_attention_s_per_score(budget_s: float, shape: tuple[int, int, int, int] = DROPOUT_ATTENTION_SHAPE) -> float:
    """Seconds one attention score element with dropout adds to a causal attention's forward+backward
    on the CPU: torch's CPU flash kernel takes no dropout, so ``scaled_dot_product_attention`` runs
    the math path (measured on a 2-core VM at 8.5-13.6 ns per score element, 1 thread, against flash
    without dropout; the ``cpu`` preset's source).

    Args:
        budget_s: time to spend, roughly (half on each variant).
        shape: (batch, heads, seq, head dim).

    Returns:
        Seconds per score element (batch x heads x seq^2), never below 0.
    """
    cpu = torch.device("cpu")
    query = torch.randn(*shape, requires_grad=True)

    def step(dropout_p: float) -> None:
        F.scaled_dot_product_attention(query, query, query, dropout_p=dropout_p, is_causal=True).sum().backward()
        query.grad = None

    fused_s = median_time_s(lambda: step(0.0), cpu, budget_s / 2, warmup=3)
    math_s = median_time_s(lambda: step(DROPOUT_P), cpu, budget_s / 2, warmup=3)
    batch, heads, seq, _ = shape
    return max(0.0, (math_s - fused_s) / (batch * heads * seq * seq))


# The smallest block: its time is nearly all per-call overhead (op dispatch, kernel launches).
OVERHEAD_BLOCK = (1, 8, 64, 4)


def block_rates(
    device: torch.device, dtype_name: str, shapes: list[tuple[int, int, int, int]], budget_s: float
) -> tuple[dict[int, float], float, float]:
    """A block's per-call overhead, the pointwise rate, and the block's rate over sizes net of both.

    Time of a block call = overhead + pointwise bytes / pointwise rate + FLOPs / rate(width): the
    overhead is what a tiny block takes; the pointwise rate is measured at the middle shape's MLP
    activation (``pointwise_gbps``); the rate of each shape is its FLOPs over what remains of its
    time (at least a tenth of it, so noise cannot make it negative). A model written with more
    pointwise ops than this block then pays for them by its own count.

    Returns:
        ({block parameter count: TFLOP/s}, overhead seconds per block forward+backward call,
        pointwise GB/s).
    """
    per_shape_s = budget_s / (len(shapes) + 2)
    _numel, _flops, _bytes, overhead_s = block_time(device, dtype_name, *OVERHEAD_BLOCK, per_shape_s)
    batch, seq, hidden, _heads = shapes[len(shapes) // 2]
    rate_gbps = pointwise_gbps(device, dtype_name, batch * seq * 4 * hidden, per_shape_s)
    curve = {}
    for shape in shapes:
        numel, flops, pointwise_bytes, seconds = block_time(device, dtype_name, *shape, per_shape_s)
        matmul_s = seconds - overhead_s - pointwise_bytes / (rate_gbps * 1e9)
        curve[numel] = flops / max(matmul_s, 0.1 * seconds) / 1e12
    return curve, overhead_s, rate_gbps
