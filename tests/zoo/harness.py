"""Runs the zoo: every model profiled and searched in this process, then one two-process launch
(gloo) trains every model under both training loops and compares it with plain PyTorch.

The two places the training-script contract reaches into the zoo are one function each:
``zoo_plan`` (which search a loop gets) and ``data_index`` (how a script takes its data slice).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.zoo.models import SEQ, ZOO, model_source

WORLD = 2
GLOBAL_BATCH = 8
MICRO_BATCH = 2  # with 2 data ranks: 2 micro-batches per step, so the plan accumulates
STEPS = 4
LOOPS = ("plain", "forward_backward")
LOSS_REL = 1e-5
WEIGHT_ABS = 1e-5
WORKER = Path(__file__).resolve().parent / "zoo_worker.py"


def zoo_plan(profile, loop: str, pins: tuple[str, ...] = ()):
    """The default search for ``loop`` ("plain" or "forward_backward") at world 2 on the cpu preset:
    the plan the search promises the script can run (plan/capabilities.py).

    Args:
        profile: the model's profile.
        loop: the training script's loop.
        pins: more ``KEY=VALUE`` search pins (scripts/zoo_report.py ``--fix``; none in the test).

    Returns:
        The search's plan.
    """
    from elixir_tune.hardware import load_hardware
    from elixir_tune.search import search

    fixed = [f"micro_batch_size={MICRO_BATCH}", *pins]
    hardware = load_hardware("cpu")
    result = search(profile, hardware, gpus_per_node=WORLD, global_batch_size=GLOBAL_BATCH, fixed=fixed, loop=loop)
    return result.plan


def data_index(model) -> tuple[int, int]:
    """This process's data-parallel index and the data-parallel degree, as a user's script takes them."""
    import elixir_tune

    return elixir_tune.data_rank(), elixir_tune.data_size()


@dataclass
class ZooResult:
    """One model under one loop.

    Attributes:
        model, loop: which.
        layout: the plan's data x pipeline x tensor, accumulation and offload, or "" without a plan.
        ok: trained and matched plain PyTorch within the tolerances.
        loss_rel, weight_abs: the largest differences (None when it did not train).
        control_abs: the weight difference of plain PyTorch accumulating the same micro-batches
            (the fp32 summation-order floor under ``weight_abs``).
        error: what failed (search, launch, a rank's exception, or the differences).
        engine_s: seconds rank 0 spent in setup and training.
    """

    model: str
    loop: str
    layout: str = ""
    ok: bool = False
    loss_rel: float | None = None
    weight_abs: float | None = None
    control_abs: float | None = None
    error: str = ""
    engine_s: float = 0.0
    trace: str = field(default="", repr=False)


def layout_of(plan) -> str:
    """``D x P x T, accum A (standard|layered), offload O/N chunks``."""
    parallel = plan.parallel
    world = plan.cluster.nodes * plan.cluster.gpus_per_node
    pipeline, tensor = parallel.pipeline.stages, parallel.tensor.degree
    chunks = plan.memory.chunks
    return (
        f"{world // (pipeline * tensor)}x{pipeline}x{tensor}, accum {plan.training.grad_accum_steps} "
        f"({plan.training.accumulation}), offload {sum(c.offload for c in chunks)}/{len(chunks)}"
    )


def plan_cases(
    names: list[str], directory: str, pins: tuple[str, ...] = ()
) -> tuple[list[dict], dict[tuple[str, str], ZooResult]]:
    """Profiles each model and searches a plan per loop (``pins``: see ``zoo_plan``); writes the
    plans under ``directory``.

    Returns:
        The worker's cases (one per model and loop with a plan) and a result per model and loop
        (those whose profile or search failed already hold the error).
    """
    from elixir_tune.plan import save_plan
    from elixir_tune.profiler import profile_model
    from elixir_tune.profiler.source import quiet_transformers

    cases, results = [], {}
    for name in names:
        try:
            with quiet_transformers():
                profile = profile_model(model_source(name), batch_size=MICRO_BATCH, seq_len=SEQ, checkpointing="all")
        except Exception as exc:
            for loop in LOOPS:
                results[name, loop] = ZooResult(name, loop, error=f"profile: {type(exc).__name__}: {exc}")
            continue
        for loop in LOOPS:
            try:
                plan = zoo_plan(profile, loop, pins)
            except Exception as exc:
                results[name, loop] = ZooResult(name, loop, error=f"search: {type(exc).__name__}: {exc}")
                continue
            path = str(Path(directory, f"{name}-{loop}.yaml"))
            save_plan(plan, path)
            results[name, loop] = ZooResult(name, loop, layout=layout_of(plan))
            cases.append({"model": name, "loop": loop, "plan": path, "steps": STEPS})
    return cases, results


def run_zoo(
    names: list[str] | None = None, pins: tuple[str, ...] = (), timeout_s: float = 420.0
) -> tuple[list[ZooResult], float]:
    """The whole zoo (or the models ``names``): plans here (``pins``: see ``zoo_plan``), then one
    launch of ``WORLD`` processes.

    Returns:
        A result per model and loop (in registry order), and the wall time in seconds.
    """
    from tests.distributed.engine_launch import launch

    started = time.perf_counter()
    names = list(ZOO) if names is None else names
    with tempfile.TemporaryDirectory() as tmp:
        cases, results = plan_cases(names, tmp, pins)
        try:
            per_rank = launch(str(WORKER), cases, WORLD, timeout_s=timeout_s) if cases else []
        except RuntimeError as exc:  # a rank died or the launch timed out: every launched case failed
            for case in cases:
                results[case["model"], case["loop"]].error = f"launch: {exc}"[:3000]
            per_rank = []
    for index, case in enumerate(cases if per_rank else []):
        result = results[case["model"], case["loop"]]
        ranks = [rank_results[index] for rank_results in per_rank]
        failed = [(rank, r) for rank, r in enumerate(ranks) if not r["ok"]]
        if failed:
            rank, first = failed[0]
            result.error, result.trace = f"rank {rank}: {first['error']}", first.get("trace", "")
            continue
        first = ranks[0]
        result.loss_rel, result.weight_abs, result.engine_s = first["loss_rel"], first["weight_abs"], first["engine_s"]
        result.control_abs = first["control_abs"]
        result.ok = result.loss_rel <= LOSS_REL and result.weight_abs <= WEIGHT_ABS  # False for NaN
        if not result.ok:
            result.error = (
                f"differs from plain PyTorch: loss rel {result.loss_rel:.3g} (limit {LOSS_REL}), "
                f"weights abs {result.weight_abs:.3g} (limit {WEIGHT_ABS}); engine losses {first['losses']}, "
                f"torch {first['ref_losses']}"
            )
    ordered = [results[name, loop] for name in names for loop in LOOPS]
    return ordered, time.perf_counter() - started
