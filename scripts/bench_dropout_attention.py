"""What an attention with dropout costs on the CPU, measured against what a CPU plan prices.

    python scripts/bench_dropout_attention.py

torch's CPU flash kernel takes no dropout, so a training step of a model whose attention has dropout
(GPT-2's ``attn_pdrop``) runs ``scaled_dot_product_attention``'s math path. Prints, 1 thread:

* the bytes one call saves for backward per score element, with and without dropout, per dtype
  (``costmodel/memory.py`` ``CPU_DROPOUT_ATTENTION_BYTES``);
* a GPT-2 of width 128, 2 blocks, seq 512, micro-batch 2: plain PyTorch's forward+backward with
  dropout 0.1 and 0, against the cost model's compute on the ``cpu`` preset for each (the difference is
  ``dropout_attention_s_per_score`` per block's ``dropout_scores_per_sample``).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

SEQ, MICRO, WIDTH, BLOCKS, HEADS = 512, 2, 128, 2, 4


def saved_bytes_per_score(dropout_p: float, dtype: torch.dtype) -> float:
    """Bytes of the distinct storages one causal attention call saves beyond q, k, v and its output."""
    query = torch.randn(2, 4, 64, 16, dtype=dtype, requires_grad=True)
    sizes: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        sizes[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = F.scaled_dot_product_attention(query, query, query, dropout_p=dropout_p, is_causal=True)
    skip = {query.untyped_storage().data_ptr(), out.untyped_storage().data_ptr()}
    return sum(n for ptr, n in sizes.items() if ptr not in skip) / (2 * 4 * 64 * 64)


def gpt2_step_s(dropout_p: float, workdir: Path) -> tuple[float, float]:
    """(predicted compute, measured median forward+backward) seconds of one micro-batch."""
    from elixir_tune.costmodel.model import CostModel
    from elixir_tune.hardware import load_hardware
    from elixir_tune.profiler import load_model_source, profile_model
    from elixir_tune.profiler.source import quiet_transformers

    config = dict(n_embd=WIDTH, n_layer=BLOCKS, n_head=HEADS, n_positions=SEQ, vocab_size=256)
    config.update(resid_pdrop=dropout_p, embd_pdrop=dropout_p, attn_pdrop=dropout_p)
    path = workdir / f"gpt2-dropout-{dropout_p}.yaml"
    path.write_text(yaml.safe_dump({"name": path.stem, "architecture": "gpt2", "seq_len": SEQ, "config": config}))
    with quiet_transformers():
        source = load_model_source(str(path))
        profile = profile_model(source, batch_size=MICRO, seq_len=SEQ)
        model = source.build_model().train()
    predicted_s, _ = CostModel(profile, load_hardware("cpu"), gpus_per_node=1, dtype="fp32")._compute_s(MICRO, 0, 0.0)
    batch = source.example_batch(MICRO, SEQ)

    def step() -> None:
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    times = []
    for _ in range(7):
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
    return predicted_s, statistics.median(times)


def main() -> int:
    torch.set_num_threads(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        with_p, without = saved_bytes_per_score(0.1, dtype), saved_bytes_per_score(0.0, dtype)
        print(f"{dtype}: saved per score element {with_p:.2f} B with dropout 0.1, {without:.2f} B without")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {p: gpt2_step_s(p, Path(tmp)) for p in (0.0, 0.1)}
    for p, (predicted_s, measured_s) in runs.items():
        print(f"GPT-2 w{WIDTH} x{BLOCKS} seq {SEQ} mb {MICRO}, dropout {p}: predicted compute "
              f"{predicted_s * 1e3:.1f} ms, measured forward+backward {measured_s * 1e3:.1f} ms")  # fmt: skip
    (p0, m0), (p1, m1) = runs[0.0], runs[0.1]
    print(f"dropout's extra: predicted {(p1 - p0) * 1e3:.1f} ms, measured {(m1 - m0) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
