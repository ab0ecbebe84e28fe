"""Fused kernels on the meta device, the way real devices run them.

Attention. On meta tensors ``F.scaled_dot_product_attention`` falls back to the math path, which keeps the
seq x seq attention matrix for backward. GPUs (flash / memory-efficient kernels) and CPUs (flash
for CPU) keep only the output and a log-sum-exp per row, so the math path would overstate
activation memory by far at seq 1024 and beyond. While profiling, calls on meta tensors go to
the memory-efficient kernel's meta implementation instead: same outputs kept, same FLOPs counted
by torch's flop formulas. Except with dropout on the CPU: torch's CPU flash kernel takes no
dropout, so a training step with ``dropout_p > 0`` (GPT-2's ``attn_pdrop``) runs the math path
there, keeping the scores' softmax, dropout noise and dropped probabilities (measured: 14 bytes per
score element in fp32, 15 in bf16). The profile is the GPU's; each such call's score elements
(batch x heads x query x key) go to ``on_dropout_scores`` so that the cost model can add what a CPU
device keeps (``costmodel/memory.py`` ``cpu_attention_dropout_bytes``). The fused kernels take 4-D
(batch, heads, seq, head dim) inputs with as many key/value heads as query heads, or fewer with
``enable_gqa``: a call outside that (Falcon's one key/value head broadcast over the query heads,
without ``enable_gqa``) runs the math path on a real device, and is profiled on it too (checked
against a real forward on the CPU: tests/unit/test_profiler_activations.py).

Grouped matmuls (mixture-of-experts layers: each token's rows times its expert's matrix). torch's
meta kernel for ``grouped_mm`` accepts bf16 only, while the model may be profiled in fp32 or fp16;
and the routing (which token goes to which expert) is data that meta tensors do not hold. Each
call is replaced by one dense matmul of the tokens with one expert's matrix: the same output
shape, the same FLOPs (every row meets exactly one expert matrix) forward and backward, and the
same tensors saved (the tokens, and a view of the weight).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

GROUPED_MM_FUNCTIONS = tuple(f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f)


class FusedKernelsOnMeta(TorchFunctionMode):
    """Routes attention and grouped matmuls on meta tensors to what a fused kernel keeps and counts."""

    def __init__(self, on_dropout_scores: Callable[[int], None] | None = None) -> None:
        """Args:
        on_dropout_scores: called with the score elements of each fused call with dropout (module docstring).
        """
        super().__init__()
        self._fused_works = hasattr(torch.ops.aten, "_scaled_dot_product_efficient_attention")
        self._on_dropout_scores = on_dropout_scores

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GROUPED_MM_FUNCTIONS and args and args[0].is_meta and len(args) > 1 and args[1].dim() == 3:
            return _grouped_mm_on_meta(args[0], args[1])
        if (
            func is F.scaled_dot_product_attention
            and self._fused_works
            and args
            and args[0].is_meta
            and _fused_kernel_takes(args, kwargs)
        ):
            try:
                out = _efficient_attention(*args, **kwargs)
            except (RuntimeError, TypeError, NotImplementedError):
                self._fused_works = False  # this torch has no meta kernel for it: keep the math path
            else:
                dropout_p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
                if dropout_p and self._on_dropout_scores is not None:
                    query, key = args[0], args[1] if len(args) > 1 else kwargs["key"]
                    self._on_dropout_scores(query.shape[:-1].numel() * key.shape[-2])
                return out
        return func(*args, **kwargs)


def _fused_kernel_takes(args: tuple, kwargs: dict) -> bool:
    """Whether torch's fused attention kernels take these arguments (else it runs the math path)."""
    tensors = [*args[:3], *(kwargs[name] for name in ("query", "key", "value")[len(args) :] if name in kwargs)]
    if len(tensors) != 3 or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return False
    heads, key_heads, value_heads = (t.shape[-3] for t in tensors)
    if key_heads == heads and value_heads == heads:
        return True
    return bool(kwargs.get("enable_gqa", False)) and heads % key_heads == 0 and key_heads == value_heads


def _efficient_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    heads = query.shape[-3]
    if key.shape[-3] != heads:  # grouped-query attention: the kernel wants as many kv heads as q heads
        key = key.repeat_interleave(heads // key.shape[-3], dim=-3)
        value = value.repeat_interleave(heads // value.shape[-3], dim=-3)
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
            bias = bias.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            bias = attn_mask.to(query.dtype)
        bias = bias.expand(query.shape[0], heads, query.shape[-2], key.shape[-2])
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, query.requires_grad or key.requires_grad, dropout_p, is_causal, scale=scale
    )
    return out[0]


def _grouped_mm_on_meta(tokens: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
    """(S, K) x (E, K, N) grouped by expert -> (S, N), as one expert's dense matmul."""
    return torch.matmul(tokens.to(expert_weights.dtype), expert_weights.select(0, 0))
