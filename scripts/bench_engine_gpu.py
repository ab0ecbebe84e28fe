"""GPU mode of bench_engine.py: step time and peak memory of a searched plan against its prediction.

    python scripts/bench_engine.py --device cuda --hardware h100-80gb-sxm --fix offload=0.5 --fix prefetch=2

One process, one GPU. The model is bench_engine's GPT-2 (``--hidden --layers ...``), profiled on
the meta device at the run's dtype; ``elixir-tune``'s search makes the plan for ``--hardware``
(a preset or a probe result: use the machine's own, ``elixir-tune probe --out hw.yaml``), with
``--fix KEY=VALUE`` pins. Timed: ``--steps`` whole optimizer steps after ``--warmup``, each between
two CUDA events with ``torch.cuda.synchronize()`` before and after (the host-side CPU optimizer
of offloaded chunks is inside the timed region: the end event is recorded after it returns).
Memory: ``torch.cuda.max_memory_allocated`` over the timed steps against ``peak_gpu_bytes``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import yaml


def _model_source(args, config: dict, directory: str):
    """The benchmark's GPT-2 as a model YAML, so that the profiler and the engine build the same model."""
    from elixir_tune.profiler import load_model_source

    path = Path(directory, "bench-gpt2.yaml")
    path.write_text(
        yaml.safe_dump({"name": "bench-gpt2", "architecture": "gpt2", "seq_len": args.seq, "config": config})
    )
    return load_model_source(str(path))


def run_gpu(args, config: dict) -> dict:
    """Searches, runs and measures one plan on ``cuda:0``; returns the figures.

    Args:
        args: bench_engine's arguments.
        config: the GPT2Config fields of the benchmark model.
    """
    import torch

    from elixir_tune.hardware import load_hardware
    from elixir_tune.profiler import profile_model
    from elixir_tune.search import search

    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is visible to torch")
    device = torch.device("cuda", 0)
    with tempfile.TemporaryDirectory() as tmp:
        source = _model_source(args, config, tmp)
        profile = profile_model(source, batch_size=args.batch, seq_len=args.seq, dtype=args.dtype, checkpointing="all")
        hardware = load_hardware(args.hardware)
        fixed = list(args.fix) + [f"dtype={args.dtype}"]
        result = search(
            profile,
            hardware,
            gpus_per_node=1,
            global_batch_size=args.batch * args.accum,
            fixed=fixed,
            loop="forward_backward",
        )
        plan = result.plan
        torch.manual_seed(0)
        model, optimizer = _setup(source, plan)
    accum = plan.training.grad_accum_steps
    batch = {k: v.to(device) for k, v in source.example_batch(plan.training.micro_batch_size, args.seq).items()}

    def step() -> None:
        for _ in range(accum):
            optimizer.backward(model(**batch).loss / accum)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    event_s, wall_s = [], []
    for _ in range(args.steps):
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(device)
        wall_s.append(time.perf_counter() - began)
        event_s.append(start.elapsed_time(end) / 1e3)
    peak = torch.cuda.max_memory_allocated(device)
    prediction = plan.prediction
    median = statistics.median(event_s)
    return {
        "device": torch.cuda.get_device_name(device),
        "hardware": args.hardware,
        "fixed": fixed,
        "plan": {
            "chunk_size": plan.memory.chunk_size,
            "cache_blocks": plan.memory.cache_blocks,
            "prefetch": plan.memory.prefetch,
            "offloaded": sum(c.offload for c in plan.memory.chunks),
            "chunks": len(plan.memory.chunks),
            "micro_batch_size": plan.training.micro_batch_size,
            "grad_accum_steps": accum,
            "checkpointing_every": plan.training.activation_checkpointing.every,
        },
        "step_time_s": {"median": median, "min": min(event_s), "all": event_s, "wall_all": wall_s},
        "predicted_step_time_s": prediction.step_time_s,
        "ratio_measured_vs_predicted_step_time": median / prediction.step_time_s,
        "peak_allocated_bytes": peak,
        "predicted_peak_gpu_bytes": prediction.peak_gpu_bytes,
        "ratio_predicted_vs_measured_peak": prediction.peak_gpu_bytes / peak,
        "engine_report": model.memory_report(),
    }


def _setup(source, plan):
    import torch

    import elixir_tune

    model = source.build_model()
    return elixir_tune.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), plan=plan)
