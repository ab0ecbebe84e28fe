"""What per-op selective activation checkpointing keeps of a Llama block, measured on the CPU.

torchtitan's "selective op" checkpointing (the policy of its Llama 3 benchmarks) keeps, inside each
block, the outputs of the matrix products except every second one and of the fused attention, and
recomputes everything else from the block's input. The plan can only checkpoint whole blocks, so
scripts/bench_published.py models it as checkpointing every 2nd block. This script runs a real
transformers Llama block (bf16, on the CPU) and counts, per token and per unit of hidden width:

* full: what autograd saves for the backward without checkpointing (unique storages);
* selective: what the op policy keeps: the block input, every other ``mm`` output, the
  attention's output (``_scaled_dot_product_*`` ops, the fused kernel on CPU as on GPU);
* every 2nd block checkpointed: (full + input) / 2 per block, as the plan models it.

    python scripts/measure_sac_activations.py                  # writes benchmarks/results/sac-activations.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from elixir_tune import paths

# The ops torchtitan's op policy saves (every second mm is recomputed instead).
ATTENTION_PREFIX = "_scaled_dot_product"


class _Outputs(TorchDispatchMode):
    """Records every op's name and output bytes in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) else out
        size = first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0
        self.ops.append((func.__name__ if hasattr(func, "__name__") else str(func), size))
        return out


def measure(hidden: int, heads: int, kv_heads: int, intermediate: int, seq: int, batch: int) -> dict:
    """Saved bytes per token per hidden unit of one Llama block: full, selective op policy, every 2nd."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        num_hidden_layers=1,
        vocab_size=128,
        max_position_embeddings=seq,
    )
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16)
    rotary = LlamaRotaryEmbedding(config)
    x = torch.randn(batch, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq).unsqueeze(0)
    cos_sin = tuple(t.to(torch.bfloat16) for t in rotary(x, positions))

    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layer(x, position_embeddings=cos_sin, attention_mask=None)
    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    full_bytes = sum(
        size for ptr, size in saved.items() if ptr not in parameters and ptr != x.untyped_storage().data_ptr()
    )

    recorder = _Outputs()
    with torch.no_grad(), recorder:
        layer(x, position_embeddings=cos_sin, attention_mask=None)
    mm_count, selective_bytes = 0, x.numel() * x.element_size()  # the block input, kept to recompute from
    for name, size in recorder.ops:
        if name.startswith("mm"):
            mm_count += 1
            selective_bytes += 0 if mm_count % 2 == 0 else size
        elif name.startswith(ATTENTION_PREFIX):
            selective_bytes += size
    unit = batch * seq * hidden
    return {
        "full": full_bytes / unit,
        "selective": selective_bytes / unit,
        "every_2nd": (full_bytes + x.numel() * x.element_size()) / 2 / unit,
        "mm_calls": mm_count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(paths.REPO_DIR / "benchmarks" / "results" / "sac-activations.md"))
    args = parser.parse_args()
    # Llama 3.1 8B's proportions at 1/16 of its width: 8 key/value heads of 32, MLP 3.5 x hidden.
    result = measure(hidden=256, heads=32, kv_heads=8, intermediate=896, seq=512, batch=2)
    text = "\n".join(
        [
            "# What selective per-op checkpointing keeps of a Llama block (CPU, bf16)",
            "",
            "Command: `python scripts/measure_sac_activations.py`. A transformers LlamaDecoderLayer with Llama 3.1 8B's "
            "proportions at 1/16 of its width (hidden 256, 32 heads, 8 key/value heads, MLP 896), sdpa attention, "
            "batch 2 x seq 512; bytes per token per unit of hidden width.",
            "",
            "| what the backward keeps | bytes / token / hidden |",
            "|---|---:|",
            f"| no checkpointing (autograd's saved tensors) | {result['full']:.1f} |",
            f"| every 2nd block checkpointed (the plan's stand-in), mean per block | {result['every_2nd']:.1f} |",
            f"| selective op policy (input + every other of {result['mm_calls']} mm outputs + attention output) | "
            f"{result['selective']:.1f} |",
            "",
        ]
    )
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
