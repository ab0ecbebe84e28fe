"""What scripts/gpu_validate.py runs: the model sized from the probe, the plan shapes, the MFU peak."""

from __future__ import annotations

import math


def gpt2_dims(target_params: float, seq: int = 1024, vocab: int = 50257) -> dict:
    """GPT-2 dimensions near ``target_params``: the narrowest width (heads of 128) at <= 48 layers."""
    for hidden in (1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192):
        per_layer = 12 * hidden * hidden + 13 * hidden
        layers = round((target_params - (vocab + seq) * hidden) / per_layer)
        if layers <= 48:
            return {"hidden": hidden, "layers": max(layers, 2), "heads": hidden // 128, "vocab": vocab, "seq": seq}
    return {"hidden": 8192, "layers": 48, "heads": 64, "vocab": vocab, "seq": seq}


def peak_tflops(spec, dtype: str) -> float:
    """Datasheet peak for MFU: the spec's, else the closest preset's, else the measured matmul rate."""
    from elixir_tune.hardware import closest_preset, load_hardware

    if spec.matmul_peak_tflops.get(dtype):
        return spec.matmul_peak_tflops[dtype]
    preset = closest_preset(spec)
    if preset and load_hardware(preset).matmul_peak_tflops.get(dtype):
        return load_hardware(preset).matmul_peak_tflops[dtype]
    return spec.matmul_tflops.get(dtype) or spec.matmul_tflops["fp32"]


def shape_pins(
    best: dict, model_path: str, hardware: str, world: int, per_rank: int
) -> list[tuple[str, list[str], str]]:
    """(name, --fix pins, strategy) of every shape after the search's best, in priority order."""
    from elixir_tune.costmodel.model import CostModel
    from elixir_tune.hardware import load_hardware
    from elixir_tune.profiler import load_profile

    shape = best["shape"]
    cost = CostModel(load_profile(model_path), load_hardware(hardware), world)
    min_cache = cost.min_cache_blocks(shape["chunk_size"], shape["checkpointing"])
    every = shape["checkpointing"]
    ckpt = "none" if every == 0 else "all" if every == 1 else f"every:{every}"
    micro = shape["micro_batch_size"]
    return [
        ("elixir-rule", [], "elixir"),
        ("full-offload", ["offload=1"], "joint"),
        (
            "no-cache",
            [f"chunk_size={shape['chunk_size']}", f"checkpointing={ckpt}", f"cache_blocks={min_cache}", "prefetch=0"],
            "joint",
        ),
        ("ckpt-none", ["checkpointing=none"], "joint"),
        ("ckpt-all", ["checkpointing=all"], "joint"),
    ] + [
        (f"micro-batch-{size}", [f"micro_batch_size={size}"], "joint") for size in other_micro_batches(micro, per_rank)
    ]


def other_micro_batches(micro: int, per_rank: int) -> list[int]:
    """The two micro-batch sizes nearest ``micro`` (by ratio) that divide the per-rank batch."""
    sizes = [size for size in range(1, per_rank + 1) if per_rank % size == 0 and size != micro]
    return sorted(sorted(sizes, key=lambda size: abs(math.log(size / micro)))[:2])
