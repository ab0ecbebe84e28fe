"""The layout costs of a CPU device measured with the engine itself: `elixir-tune probe`'s last part.

The probe proper (``elixir_tune.hardware``) stays below the engine, so its layout benchmark
(``hardware/bench_layout.py``) times torch's pieces alone: DTensor blocks and torch's pipeline schedule
over plain blocks. The engine's own work per micro-batch comes on top: the stage adapter running the
causal LM's forward around a virtual stage's blocks, the chunk hooks of every module, the gradient
hooks, token weighting and the loss. This module measures it where the layering allows (the CLI may
import the profiler, the search and the engine): it trains a tiny GPT-2 (``ENGINE_MODEL_YAML``, whose
compute is next to nothing, so its step is mostly these fixed costs) with the engine in 2 worker
processes (``probe_engine_worker.py``) under the search's plans for pipeline 2 and tensor 2 (and data
parallelism alone without ``quick``, as a check of the rest of the spec at this size); then asks the cost model
what each plan takes without the layout's fixed cost (``pipeline_stage_microbatch_s``,
``tensor2_block_fixed_s`` next to 0) and with a small one, and sets each fixed cost to what makes the
prediction the measured step:

    fixed = (measured - predicted without it) / (d predicted / d fixed)

(the cost model's step is linear in either). So each fixed cost holds whatever the engine's step of
that layout takes per virtual stage and micro-batch (per tensor-split block and micro-batch) beyond
what the rest of the spec already predicts. The layout ratios (a share of the compute) stay the
benchmark's: with a tiny model they hardly enter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from elixir_tune.cpu_binding import binding_preexec
from elixir_tune.hardware import HardwareSpec, probe
from elixir_tune.hardware.timing import quartiles_note
from elixir_tune.hardware.workers import free_port, supervise

# A GPT-2 (configs/models/ format) so small that its step is mostly fixed costs; 4 blocks as the
# layout benchmark's pipeline (2 virtual stages per rank under pipeline 2).
ENGINE_MODEL_YAML = """\
name: probe-gpt2-32x4
architecture: gpt2
seq_len: 8
config:
  n_embd: 32
  n_layer: 4
  n_head: 2
  n_positions: 8
  vocab_size: 256
  bos_token_id: 0
  eos_token_id: 0
  resid_pdrop: 0.0
  embd_pdrop: 0.0
  attn_pdrop: 0.0
"""
GLOBAL_BATCH = 8
SEQ_LEN = 8
WORLD = 2
# Pins of each measured plan: every chunk cached, nothing offloaded, no recomputation; the micro-batches
# of the benchmark GPT-2's plans (scripts/bench_prediction.py --layouts: 8 x 1, 4 x 4, 16 x 1) at half
# the batch: one micro-batch per step for data parallelism and tensor 2, 4 through the pipeline.
COMMON_PINS = {"cache_blocks": "all", "offload": 0.0, "checkpointing": "none", "dtype": "fp32"}
LAYOUT_PINS = {
    "data": {"pipeline": 1, "tensor": 1, "micro_batch_size": 4},
    "pipeline2": {"pipeline": 2, "micro_batch_size": 2},
    "tensor2": {"tensor": 2, "micro_batch_size": 8},
}
# The spec field each layout's fixed cost is, and the step by which its slope is taken (seconds).
FIXED_FIELDS = {"pipeline2": "pipeline_stage_microbatch_s", "tensor2": "tensor2_block_fixed_s"}
SLOPE_STEP_S = 1e-3
# Timed engine steps per plan (after 1 or 2 untimed). The quick probe's 5 moved tensor2_block_fixed_s
# 45-57 ms from probe to probe; a step of the tiny model takes 0.1-0.25 s.
ENGINE_STEPS_QUICK, ENGINE_STEPS = 10, 15
# The fixed cost of the prediction "without it": not 0, which the cost model reads as "not measured"
# (it then prices the layout's sends and collectives on the links instead).
BASE_FIXED_S = 1e-9

Progress = Callable[[str], None] | None


def probe_with_engine(
    quick: bool = False, progress: Progress = None, procs: int | None = None, device: str | None = None
) -> HardwareSpec:
    """``elixir_tune.hardware.probe``, then on a CPU device of 2 processes the layout fixed costs
    measured with the engine (``engine_layout_costs``).

    Args:
        quick: fewer sizes and repeats (and fewer timed engine steps).
        progress: called with a short description as each measurement starts.
        procs: worker processes when the CPU is the device (default 2); ignored with GPUs.
        device: "cuda" or "cpu" to force one; default cuda when available.

    Returns:
        The measured spec.

    Raises:
        ProbeError: a measurement of the probe proper failed.
        RuntimeError: an engine worker failed or timed out.
    """
    spec = probe(quick=quick, progress=progress, procs=procs, device=device)
    if spec.device == "cpu" and spec.gpus_per_node == WORLD:
        spec = engine_layout_costs(spec, quick=quick, progress=progress)
    return spec


def _with_fixed(spec: HardwareSpec, fixed_s: dict[str, float], sources: dict[str, str] | None = None) -> HardwareSpec:
    """``spec`` with the fixed costs named in ``fixed_s`` (``FIXED_FIELDS``' values) replaced."""
    return dataclasses.replace(
        spec,
        pipeline_stage_microbatch_s=fixed_s.get("pipeline_stage_microbatch_s", spec.pipeline_stage_microbatch_s),
        tensor2_block_fixed_s=fixed_s.get("tensor2_block_fixed_s", spec.tensor2_block_fixed_s),
        sources=spec.sources if sources is None else sources,
    )


def _plan(profile, spec: HardwareSpec, pins: dict):
    """The search's plan with these pins (the rest its own choice) on ``spec``."""
    from elixir_tune.search import search

    return search(profile, spec, WORLD, global_batch_size=GLOBAL_BATCH, fixed=pins, loop="forward_backward").plan


def run_engine_workers(model_path: Path, plans: dict[str, Path], threads: int, warmup: int, steps: int) -> dict:
    """Trains the model under each plan in ``WORLD`` fresh worker processes (``probe_engine_worker``).

    Args:
        model_path: the model YAML.
        plans: name -> plan YAML, timed in this order.
        threads: CPU threads per worker.
        warmup: untimed steps per plan.
        steps: timed steps per plan.

    Returns:
        name -> rank 0's seconds per timed step.

    Raises:
        RuntimeError: a worker failed or timed out (the message carries its output's tail).
    """
    timeout_s = 60 + 30 * len(plans)
    work = model_path.parent
    out_path = work / "times.json"
    config_path = work / "engine-probe.json"
    config = {
        "model_path": str(model_path),
        "plans": {name: str(path) for name, path in plans.items()},
        "threads": threads,
        "warmup": warmup,
        "steps": steps,
        "out_path": str(out_path),
    }
    config_path.write_text(json.dumps(config))
    port = free_port()
    package_root = str(Path(__file__).resolve().parents[2])
    procs, logs = [], []
    for rank in range(WORLD):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(WORLD),
            LOCAL_WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=str(threads),
            PYTHONWARNINGS="ignore",
            TRANSFORMERS_VERBOSITY="error",
        )
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        logs.append(work / f"rank{rank}.log")
        with open(logs[-1], "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "elixir_tune.cli.probe_engine_worker", str(config_path)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Each worker on cores of its own, as elixir-run binds a CPU plan's workers.
                    preexec_fn=binding_preexec(rank, WORLD),
                )
            )
    supervise(procs, logs, timeout_s, "engine probe worker")
    return json.loads(out_path.read_text())


def fixed_cost_s(measured_s: float, predicted_s: float, predicted_with_step_s: float) -> float:
    """The fixed cost that makes the prediction the measured step (never below 0).

    Args:
        measured_s: the engine's step.
        predicted_s: the cost model's step with the fixed cost 0.
        predicted_with_step_s: the same with the fixed cost ``SLOPE_STEP_S``.

    Returns:
        Seconds.

    Raises:
        ValueError: the prediction does not grow with the fixed cost (the plan does not use it).
    """
    slope = (predicted_with_step_s - predicted_s) / SLOPE_STEP_S
    if slope <= 0:
        raise ValueError(f"the predicted step does not grow with the fixed cost (slope {slope:g})")
    return max(0.0, (measured_s - predicted_s) / slope)


def tiny_profile(work: Path):
    """The profile of ``ENGINE_MODEL_YAML`` (written to ``work/model.yaml``) and the model's path."""
    from elixir_tune.profiler import load_model_source, profile_model

    model_path = work / "model.yaml"
    model_path.write_text(ENGINE_MODEL_YAML)
    profile = profile_model(load_model_source(str(model_path)), batch_size=GLOBAL_BATCH // WORLD, seq_len=SEQ_LEN)
    return profile, model_path


def layout_plans(profile, spec: HardwareSpec, check: bool = True) -> dict:
    """The plans the engine is timed under (``LAYOUT_PINS``), searched on ``spec`` with the fixed costs
    next to 0: each plan's prediction is its step without them. ``check`` False: without the
    data-parallel one (the quick probe's)."""
    bare = _with_fixed(spec, dict.fromkeys(FIXED_FIELDS.values(), BASE_FIXED_S))
    names = list(LAYOUT_PINS) if check else list(FIXED_FIELDS)
    return {name: _plan(profile, bare, {**COMMON_PINS, **LAYOUT_PINS[name]}) for name in names}


def fit_fixed_costs(
    profile,
    spec: HardwareSpec,
    plans: dict,
    measured_s: dict[str, float],
    steps: int,
    spreads: dict[str, str] | None = None,
) -> HardwareSpec:
    """``spec`` with each layout's fixed cost set so that its plan's prediction is the measured step.

    Args:
        profile: the tiny model's profile.
        spec: the probed spec.
        plans: ``layout_plans(profile, spec)``.
        measured_s: plan name -> the engine's median step.
        steps: timed steps behind each median (for the sources).
        spreads: plan name -> how its steps spread (``timing.quartiles_note``), for the sources.

    Returns:
        A copy of ``spec`` with ``pipeline_stage_microbatch_s``, ``tensor2_block_fixed_s`` and their sources.
    """
    bare = _with_fixed(spec, dict.fromkeys(FIXED_FIELDS.values(), BASE_FIXED_S))
    predicted = {name: plan.prediction.step_time_s for name, plan in plans.items()}
    data_note = (
        f"; data parallelism alone at the same shape measured {measured_s['data'] * 1e3:.1f} ms against "
        f"{predicted['data'] * 1e3:.1f} ms predicted"
        if "data" in plans
        else ""
    )
    fields: dict[str, float] = {}
    sources = dict(spec.sources)
    for name, field in FIXED_FIELDS.items():
        plan = plans[name]
        pins = {
            **COMMON_PINS,
            **LAYOUT_PINS[name],
            "chunk_size": plan.memory.chunk_size,
            "accumulation": plan.training.accumulation,
        }
        stepped = _plan(profile, _with_fixed(bare, {field: BASE_FIXED_S + SLOPE_STEP_S}), pins)
        fields[field] = fixed_cost_s(measured_s[name], predicted[name], stepped.prediction.step_time_s)
        per = "virtual stage" if name == "pipeline2" else "tensor-split block"
        sources[field] = (
            f"measured with the engine: elixir-tune probe trained a GPT-2 of hidden 32, 4 blocks, seq {SEQ_LEN} "
            f"at world {WORLD} under the search's {name} plan ({plan.training.grad_accum_steps} micro-batch(es) of "
            f"{plan.training.micro_batch_size}), median of {steps} steps {measured_s[name] * 1e3:.1f} ms against "
            f"{predicted[name] * 1e3:.1f} ms predicted without this cost: the difference per {per} and micro-batch "
            f"(cli/probe_engine.py){data_note}"
            + (f"; the steps: {spreads[name]}" if spreads and name in spreads else "")
        )
    return _with_fixed(spec, fields, sources)


def engine_layout_costs(spec: HardwareSpec, quick: bool = True, progress: Progress = None) -> HardwareSpec:
    """``spec`` with ``pipeline_stage_microbatch_s`` and ``tensor2_block_fixed_s`` measured with the engine.

    Args:
        spec: a probed CPU spec of 2 processes (its rates predict the tiny model's steps).
        quick: ``ENGINE_STEPS_QUICK`` timed steps per plan instead of ``ENGINE_STEPS``, and no data-parallel
            plan (a check, not needed for the fit).
        progress: called with a short description as the measurement starts.

    Returns:
        A copy of ``spec`` with the two fixed costs and their ``sources`` (module docstring).

    Raises:
        ValueError: not a CPU spec of 2 processes.
        RuntimeError: an engine worker failed or timed out.
    """
    from elixir_tune.plan import save_plan

    if spec.device != "cpu" or spec.gpus_per_node != WORLD:
        raise ValueError(f"the engine's layout costs are measured on a CPU device of {WORLD} processes")
    if progress is not None:
        progress("the engine's pipeline 2 and tensor 2 steps (a tiny GPT-2, 2 processes)")
    # The first step records the chunk trace and checks the model: untimed.
    warmup, steps = (1, ENGINE_STEPS_QUICK) if quick else (2, ENGINE_STEPS)
    with tempfile.TemporaryDirectory(prefix="elixir-engine-probe-") as tmp:
        work = Path(tmp)
        profile, model_path = tiny_profile(work)
        plans = layout_plans(profile, spec, check=not quick)
        paths = {}
        for name, plan in plans.items():
            paths[name] = work / f"{name}.yaml"
            save_plan(plan, paths[name])
        threads = max(1, spec.host_cores // WORLD)
        times = run_engine_workers(model_path, paths, threads, warmup, steps)
    measured_s = {name: statistics.median(times[name]) for name in plans}
    spreads = {name: quartiles_note(times[name]) for name in plans}
    return fit_fixed_costs(profile, spec, plans, measured_s, steps, spreads)
