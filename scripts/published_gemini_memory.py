"""Gemini 10B 'cuda' on 4 A100 80GB at batch 8: the predicted peak memory of the run the README reports as OOM.

Colossal-AI's GPT-2 example (examples/language/gpt/README.md @ d96cc37e) lists 'cuda' placement of the 10B
model on 4 GPUs at batch 8 per GPU as out of memory. At that commit a gathered chunk is released only by a
placement policy's ``evict_tensors`` (``CUDAPlacementPolicy`` never evicts) or by ``ChunkManager.reduce_chunk``
after its gradients in the backward, so every chunk stays gathered from its first use until its reduction:
``cache_blocks all`` in plan terms. This prints the pinned plan's predicted peak with that cache and with the
search's own cache and prefetch, beside the preset's usable memory (benchmarks/results/published.md, closing note).

    python scripts/published_gemini_memory.py
"""

from __future__ import annotations

import dataclasses

import bench_published
from published_setups import PUBLISHED

# The README's 'const' row of the same model, GPUs and batch: only the placement differs.
SAME_RUN = "GPT-2 10B 4xA100-80G-PCIe (Gemini const, batch 8)"


def main() -> None:
    setup = next(setup for setup in PUBLISHED if setup.name == SAME_RUN)
    cuda = dataclasses.replace(setup, name="GPT-2 10B 4xA100-80G-PCIe (Gemini cuda, batch 8)", offload=0.0)
    profile = bench_published.profile_of(cuda)
    cases = (
        ("Gemini's: every chunk gathered, fetched when its op starts", "all", 0),
        ("the search's cache and prefetch", None, None),
    )
    for label, cache, prefetch in cases:
        pinned = dataclasses.replace(cuda, cache_blocks=cache, prefetch=prefetch)
        result = bench_published.best_plan(profile, pinned, bench_published.pinned_choices(pinned), lift_memory=True)
        if "error" in result:
            print(f"{label}: no plan ({result['error']})")
            continue
        print(
            f"{label}: cache {result['shape']['cache_blocks']}/{result['shape']['cacheable_chunks']}, prefetch "
            f"{result['shape']['prefetch']}: predicted peak {result['peak_gpu_gib']} GiB of {result['usable_gib']} "
            f"GiB usable{' (over: limit lifted)' if result['over_usable_memory'] else ''}"
        )


if __name__ == "__main__":
    main()
