"""Analytic profiles and hardware for tests and benchmarks, without tracing a model.

``gpt2_profile`` builds the profile the profiler would write for a HuggingFace GPT-2 (tied
embeddings, parameter names as in ``GPT2LMHeadModel``): the module-level access trace, blocks,
FLOPs (matmuls and attention) and activation lines (Korthikanti et al. for 16-bit activations).
``example_hardware`` is an A100-40GB PCIe-like node. Neither is a measurement.
"""

from __future__ import annotations

from typing import cast

from elixir_tune.hardware.spec import HardwareSpec
from elixir_tune.plan.schema import Dtype
from elixir_tune.profiler.schema import ActivationLine, BlockInfo, ModelArch, ModelProfile, ParamInfo

# hidden, layers, heads of the Elixir paper's benchmark models (REFERENCE.md), and GPT-2 sizes.
GPT2_SIZES = {
    "gpt2-tiny": (64, 2, 2),
    "gpt2": (768, 12, 12),
    "gpt2-4b": (3072, 32, 24),
    "gpt2-10b": (4096, 48, 32),
    "gpt2-15b": (8192, 18, 64),
    "gpt2-20b": (8192, 24, 64),
}


def gpt2_profile(
    name: str = "gpt2",
    *,
    hidden: int | None = None,
    layers: int | None = None,
    heads: int | None = None,
    vocab: int = 50257,
    positions: int = 1024,
    seq_len: int = 1024,
    dtype: str = "bf16",
    flash_attention: bool = False,
    dropout: bool = True,
    fused_loss: bool = False,
) -> ModelProfile:
    """An analytic profile of a GPT-2 language model.

    Args:
        name: a key of GPT2_SIZES, or any name when hidden/layers/heads are given.
        hidden: hidden size.
        layers: number of blocks.
        heads: attention heads.
        vocab: vocabulary size.
        positions: position embeddings.
        seq_len: tokens per sample.
        dtype: compute dtype.
        flash_attention: the attention keeps no seq x seq scores (FlashAttention): the
            activation lines drop Korthikanti's 5 x heads x seq^2 bytes per layer.
        dropout: the blocks drop out after the attention and after the MLP, keeping a 1-byte mask
            of seq x hidden each (2 of Korthikanti et al.'s 34 bytes per token and hidden unit);
            False for a model trained without dropout (MPT: its config's pdrops default to 0).
        fused_loss: the loss is a fused cross-entropy kernel that keeps only the logits in the
            compute dtype (flash-attn's ``CrossEntropyLoss``, MPT's default ``fused_crossentropy``
            in llm-foundry's ``modeling_mpt.py``): 2 bytes per logit, where an unfused loss under
            autocast also keeps an fp32 copy (6 bytes).

    Returns:
        The profile.
    """
    if hidden is None or layers is None or heads is None:
        hidden, layers, heads = GPT2_SIZES[name]
    params: list[ParamInfo] = []
    trace: list[list[int]] = []

    def add(param_name: str, shape: list[int], shared: bool = False) -> int:
        numel = 1
        for size in shape:
            numel *= size
        params.append(ParamInfo(name=param_name, shape=shape, dtype="float32", numel=numel, shared=shared))
        return len(params) - 1

    def module(prefix: str, shapes: list[list[int]]) -> None:
        trace.append([add(f"{prefix}.{kind}", shape) for kind, shape in zip(("weight", "bias"), shapes, strict=False)])

    wte = add("transformer.wte.weight", [vocab, hidden], shared=True)
    trace.append([wte])
    trace.append([add("transformer.wpe.weight", [positions, hidden])])
    blocks = []
    token_flops = 2 * seq_len
    attention_flops = 2 * 2 * seq_len * seq_len * hidden
    scores = 0 if flash_attention else 5 * heads * seq_len / hidden
    per_layer_act = seq_len * hidden * (34 - (0 if dropout else 2) + scores)
    for layer in range(layers):
        first = len(params)
        p = f"transformer.h.{layer}"
        module(f"{p}.ln_1", [[hidden], [hidden]])
        module(f"{p}.attn.c_attn", [[hidden, 3 * hidden], [3 * hidden]])
        module(f"{p}.attn.c_proj", [[hidden, hidden], [hidden]])
        module(f"{p}.ln_2", [[hidden], [hidden]])
        module(f"{p}.mlp.c_fc", [[hidden, 4 * hidden], [4 * hidden]])
        module(f"{p}.mlp.c_proj", [[4 * hidden, hidden], [hidden]])
        matmul_numel = 12 * hidden * hidden
        blocks.append(
            BlockInfo(
                index=layer,
                first_param=first,
                num_params=len(params) - first,
                fwd_flops_per_sample=token_flops * matmul_numel + attention_flops,
                activation_bytes_per_sample=int(per_layer_act),
                boundary_bytes_per_sample=seq_len * hidden * 2,
            )
        )
    module("transformer.ln_f", [[hidden], [hidden]])
    trace.append([wte])  # lm_head, tied to wte
    trace = trace + trace[::-1]
    fwd_flops = sum(b.fwd_flops_per_sample for b in blocks) + token_flops * vocab * hidden
    logits_bytes = seq_len * vocab * (2 if fused_loss else 6)  # bf16 logits (and an unfused loss's fp32 copy)
    plain = ActivationLine(fixed_bytes=0, per_sample_bytes=int(layers * per_layer_act + logits_bytes))
    checkpointed = ActivationLine(
        fixed_bytes=0, per_sample_bytes=int(layers * seq_len * hidden * 2 + per_layer_act + logits_bytes)
    )
    num_params = sum(p.numel for p in params)
    return ModelProfile(
        name=name,
        source=f"configs/models/{name}.yaml",
        fingerprint="synthetic0000000",
        num_params=num_params,
        dtype=cast(Dtype, dtype),
        batch_size=1,
        seq_len=seq_len,
        params=params,
        trace=trace,
        flops_per_sample=3 * fwd_flops,
        activation=plain,
        trace_checkpointed=[],
        block_list="transformer.h",
        blocks=blocks,
        recompute_flops_per_sample=sum(b.fwd_flops_per_sample for b in blocks),
        activation_checkpointed=checkpointed,
        buffers_bytes=0,
        summary=f"{name}: {num_params / 1e9:.2f}B parameters (analytic)",
        arch=ModelArch("gpt2", hidden, heads, heads, 4 * hidden, vocab, layers, attention_scores=not flash_attention),
    )


def example_hardware(
    gpu_memory_gib: float = 40.0, host_memory_gib: float = 512.0, gpus_per_node: int = 8
) -> HardwareSpec:
    """An A100-40GB PCIe-like node (round datasheet-style numbers, not a measurement).

    Args:
        gpu_memory_gib: memory of one GPU.
        host_memory_gib: host RAM of the node.
        gpus_per_node: GPUs per node.

    Returns:
        The spec.
    """
    total = int(gpu_memory_gib * 2**30)
    return HardwareSpec(
        name="example-a100",
        device="cuda",
        device_name="A100-like",
        gpus_per_node=gpus_per_node,
        gpu_memory_bytes=total,
        usable_memory_bytes=total - 2**30,
        allocator_overhead_bytes=2**30,
        matmul_tflops={"fp32": 19.5, "tf32": 120.0, "bf16": 200.0, "fp16": 200.0},
        hbm_gbps=1300.0,
        h2d_gbps=24.0,
        d2h_gbps=24.0,
        h2d_gbps_all=12.0,
        d2h_gbps_all=12.0,
        allgather_gbps=20.0,
        reduce_scatter_gbps=20.0,
        inter_node_gbps=10.0,
        gpu_adam_elems_per_s=2.5e10,
        cpu_adam_elems_per_s=1.0e9,
        host_memory_bytes=int(host_memory_gib * 2**30),
        host_cores=64,
    )
