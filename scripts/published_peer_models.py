"""The peers' models and cards as their published runs had them, for the rows pinned to them
(scripts/bench_selective.py, scripts/bench_published.py).

Cards: torchtitan's Llama-3.1 H100 rows (benchmarks/llama3_h100_202412_torchtitan.md @ b5bcd76, 'Hardware':
"Each H100 GPU is equipped with 96GB HBM2e with 2.4 TB/sec peak memory bandwidth", Grand Teton, 500 W) ran
on 96 GB cards. No preset describes that part (its compute peak is "between SXM and NVL", the source says);
its rows borrow h100-80gb-sxm's rates and compare their peak with 96 GB (``card_memory``;
``published_setups.H100_96GB_BYTES``).

Models: torchtitan's Llama.

torchtitan's Llama and transformers' ``LlamaForCausalLM`` run the same matrix products, attention and SwiGLU,
and keep the same tensors for backward, except in the norm. torchtitan's ``norm_type = "fused_rmsnorm"``
(``train_configs/llama2_13b.toml`` and ``llama3_8b.toml`` at 0413364, the commit of docs/performance.md's
64 x A100 tables) is ``TritonFusedRMSNorm`` (``torchtitan/models/norms.py``): one kernel that computes in
fp32 and saves only its input, its weight and one fp32 ``rstd`` per row. transformers' ``LlamaRMSNorm``
upcasts its input and saves the fp32 copy (4 bytes per element) and the bf16 normalized input of the
weight product (2 bytes) where the fused norm keeps its bf16 input (2 bytes): 4 bytes per token and hidden
unit less per norm, 8 per block, saved for backward by a real bf16 forward
(tests/unit/test_profiler_activations_published.py). The meta trace, which counts what is live (the first
norm's input is the block's input, live anyway), goes from 47.63 to 37.63 bytes per token and hidden unit
per block for Llama-2 13B at seq 4096 in bf16. torchtitan's plain ``rmsnorm`` (``llama2_70b.toml`` at 0413364; every Llama-3.1 row at
9dec370) upcasts like transformers, so those rows keep transformers' model.

The profile of a fused-norm row is transformers' Llama from the model YAML with each norm replaced by
``FusedRMSNorm`` below: the same save set as torchtitan's kernel (input, weight, rstd), written in torch.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from elixir_tune import paths
from elixir_tune.hardware import load_hardware
from elixir_tune.hardware.spec import HardwareSpec
from elixir_tune.profiler.schema import ModelProfile

# torchtitan's norm_type per (model YAML, source commit) where it is "fused_rmsnorm" (train_configs/*.toml).
FUSED_NORM_MODELS = ("llama2-13b", "llama3-8b")


def card_memory(preset: str, gpu_memory_bytes: int) -> HardwareSpec:
    """``preset`` with another card's memory: its rates borrowed, the same CUDA context reserved."""
    spec = load_hardware(preset)
    context_bytes = spec.gpu_memory_bytes - spec.usable_memory_bytes
    return dataclasses.replace(
        spec,
        name=f"{spec.name} with {gpu_memory_bytes / 1e9:.0f} GB",
        gpu_memory_bytes=gpu_memory_bytes,
        usable_memory_bytes=gpu_memory_bytes - context_bytes,
    )


class _FusedRMSNormFunction(torch.autograd.Function):
    """RMSNorm in fp32 that keeps only ``x``, ``weight`` and the fp32 ``rstd`` per row for backward
    (torchtitan's ``TritonFusedRMSNorm`` save set)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x_fp32 = x.float()
        rstd = torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x_fp32 * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.float() * rstd
        grad_fp32 = grad_out.float()
        weighted = grad_fp32 * weight.float()
        # d/dx of x * rstd(x): rstd * (g - x_hat * mean(g * x_hat)) per row.
        grad_x = rstd * (weighted - x_hat * (weighted * x_hat).mean(-1, keepdim=True))
        grad_weight = (grad_fp32 * x_hat).reshape(-1, x.shape[-1]).sum(0)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class FusedRMSNorm(nn.Module):
    """A drop-in for transformers' ``LlamaRMSNorm`` (same ``weight``) with the fused kernel's save set."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedRMSNormFunction.apply(x, self.weight, self.eps)


def fuse_norms(model: nn.Module) -> nn.Module:
    """Replaces every ``*RMSNorm`` module of ``model`` with ``FusedRMSNorm`` (its weight kept), in place."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RMSNorm") and not isinstance(module, FusedRMSNorm):
            parent_name, _, child = name.rpartition(".")
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
            setattr(model.get_submodule(parent_name), child, FusedRMSNorm(module.weight, eps))
    return model


@functools.cache
def fused_norm_profile(model: str, seq_len: int, dtype: str, checkpointing: str) -> ModelProfile:
    """The profile of a model YAML's transformers Llama with torchtitan's fused norm (cached per shape).

    Args:
        model: a model YAML under configs/models (a Llama).
        seq_len: tokens per sample.
        dtype: compute dtype.
        checkpointing: the profiler's ``checkpointing`` ("all" also traces every block checkpointed).
    """
    from elixir_tune.profiler import profile_model
    from elixir_tune.profiler.source import load_model_source

    source = load_model_source(str(paths.MODEL_CONFIGS_DIR / f"{model}.yaml"))
    build = source._build
    fused = dataclasses.replace(source, _build=lambda: fuse_norms(build()))
    return profile_model(fused, batch_size=1, seq_len=seq_len, dtype=dtype, checkpointing=checkpointing)
