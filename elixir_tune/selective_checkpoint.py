"""Selective activation checkpointing: torchtitan's per-op policy under torch's own SAC contexts.

A selectively checkpointed block runs under ``torch.utils.checkpoint.checkpoint`` (non-reentrant)
with ``context_fn=selective_context``. Its forward keeps the outputs of the ops the policy saves and
drops the rest; its backward runs the block's forward again, and the saved ops return their kept
outputs instead of running. The policy is torchtitan's op-level SAC ("selective" mode, option
"op": ``_save_list`` and ``_get_custom_policy`` of pytorch/torchtitan's Llama ``parallelize_llama.py``
in 2024, the code its published Llama runs used):

* every other matrix product is saved, counted in order within the block: the 1st, 3rd, 5th ...
  (in a Llama block wq, wv, w1 and w2; wk, wo and w3 run again);
* the attention kernels' outputs are saved (no attention recomputes);
* a tensor-parallel reduce-scatter's output and ``max`` (fp8 scaling) are saved;
* everything else (norms, activations, rotary embedding, residual adds: memory-bound) recomputes.

torchtitan counts ``aten.mm`` only (its linears have no bias). Here ``aten.addmm`` (a linear with a
bias, transformers' GPT-2 ``Conv1D``) counts as a matrix product too, and the CPU's flash attention
kernel is an attention kernel. torchtitan does not restore the RNG state for the recomputation; the
engine does (torch's default), so a block with dropout recomputes the same masks. Shared by the engine
(training) and the profiler (which traces the same policy on the meta device to measure what it keeps
and what it recomputes).
"""

from __future__ import annotations

import collections
import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
MATMUL_OPS = frozenset({_aten.mm.default, _aten.addmm.default})
ALWAYS_SAVED_OPS = frozenset(
    op
    for op in (
        getattr(_aten, "_scaled_dot_product_flash_attention", None),
        getattr(_aten, "_scaled_dot_product_efficient_attention", None),
        getattr(_aten, "_scaled_dot_product_cudnn_attention", None),
        getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),
        getattr(getattr(torch.ops, "_c10d_functional", None), "reduce_scatter_tensor", None),
        _aten.max,
    )
    if op is not None
    for op in [op.default]
)


def policy(counts: collections.Counter, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Save or recompute one op's output (module docstring).

    Args:
        counts: matrix products seen so far in this block's forward and in its recomputation,
            apart (both must count the same products for the recomputation to find its outputs).
        ctx: torch's policy context (``is_recompute``).
        func: the ATen op.
    """
    if func in MATMUL_OPS:
        run = "recompute" if ctx.is_recompute else "forward"
        counts[run] += 1
        return CheckpointPolicy.MUST_SAVE if counts[run] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if func in ALWAYS_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """The ``context_fn`` of one selectively checkpointed block call (fresh counts per call)."""
    return create_selective_checkpoint_contexts(functools.partial(policy, collections.Counter()))
