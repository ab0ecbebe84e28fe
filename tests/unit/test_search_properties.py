"""The search is right about itself, over presets x worlds x models.

For every case the default (free) search's plan passes ``validate``; its predicted device peak, with
the margin the search keeps free, fits the device it was made for (every pipeline stage's), and its
host peak the host; no resource of its predicted timeline is busy longer than the step; the
prediction's memory figures are one stage's (``show`` reports them as such); and its step is no
slower than the best the search finds with each parallel layout it allows pinned (where it had several).

Each case runs for both training loops the search knows (``search(loop=...)``): under the plain loop
every plan is data-parallel with standard accumulation, under ``forward_backward`` every layout the
model runs is in play.
"""

from __future__ import annotations

import functools
import itertools

import pytest

from elixir_tune.costmodel.memory import SHARD_BYTES
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.paths import MODEL_CONFIGS_DIR
from elixir_tune.plan import validate
from elixir_tune.search import InfeasibleError, search

PRESETS = ("cpu", "a100-40gb-pcie", "h100-80gb-sxm")
WORLDS = ((1, 1), (1, 2), (1, 8), (2, 8))  # (nodes, GPUs per node)
# The multi-billion model takes seconds per case (many chunk sizes and layouts): slow.
MODELS = ("gpt2-tiny", "llama-tiny", "opt-125m", pytest.param("gpt2-4b", marks=pytest.mark.slow))
LOOPS: tuple[str | None, ...] = ("plain", "forward_backward")
# Slack for float rounding in the comparisons of predicted seconds.
EPS_S = 1e-9


@functools.cache
def profile_of(name: str):
    """A model profile: the real profiler's for the config YAMLs (meta device, seconds), the
    synthetic GPT-2 for the multi-billion model (its memory does not fit every preset)."""
    if name == "gpt2-4b":
        return gpt2_profile("gpt2-4b")
    from elixir_tune.profiler.profile import profile_model

    return profile_model(str(MODEL_CONFIGS_DIR / f"{name}.yaml"), seq_len=128)


def run_search(profile, hardware, nodes: int, gpus: int, loop: str | None, fixed: list[str] | None = None):
    extra = {"loop": loop} if loop is not None else {}
    return search(profile, hardware, gpus_per_node=gpus, nodes=nodes, fixed=fixed, **extra)


def _grid() -> list:
    """Every preset x world x model x loop, except some of the multi-billion model's (slow), whose
    paths other cases take: its forward_backward searches (pipeline and tensor layouts, each pinned
    again: 3-15 s) run at one 8-GPU node only and not on the H100 (80 GB: less memory pressure than
    the A100's 40 GB, which keeps them), and it skips the 2-GPU world (data parallelism within a node
    as at 8 GPUs, which it runs; the small models cover 2 GPUs under both loops)."""
    cases = []
    for preset, (nodes, gpus), model, loop in itertools.product(PRESETS, WORLDS, MODELS, LOOPS):
        name = model if isinstance(model, str) else model.values[0]
        if name == "gpt2-4b" and (nodes, gpus) == (1, 2):
            continue
        if name == "gpt2-4b" and loop == "forward_backward" and ((nodes, gpus) != (1, 8) or preset == "h100-80gb-sxm"):
            continue
        marks = () if isinstance(model, str) else model.marks
        cases.append(
            pytest.param(preset, (nodes, gpus), name, loop, marks=marks, id=f"{preset}-{nodes}x{gpus}-{name}-{loop}")
        )
    return cases


@pytest.mark.parametrize(("preset", "world", "model_name", "loop"), _grid())
def test_every_plan_validates_fits_and_is_the_search_best(preset, world, model_name, loop):
    nodes, gpus = world
    hardware = load_hardware(preset)
    profile = profile_of(model_name)
    try:
        result = run_search(profile, hardware, nodes, gpus, loop)
    except InfeasibleError:
        return  # nothing fits (the error path has its own tests)
    plan, best = result.plan, result.candidates[0]
    assert validate(plan) == []
    if loop == "plain":
        assert plan.parallel.is_default() and plan.training.accumulation == "standard"
    prediction = plan.prediction
    assert prediction is not None

    # Memory: every stage fits its device with the margin, the node's host holds the host part.
    stages = getattr(best, "stages", ()) or ((result.model, best),)
    for _model, stage in stages:
        assert stage.memory.required_gpu_bytes <= hardware.usable_memory_bytes
    assert prediction.peak_gpu_bytes <= hardware.usable_memory_bytes
    assert prediction.peak_host_bytes <= hardware.host_memory_bytes
    if hardware.device == "cpu":  # one pool: the ranks' device parts and the host part share the RAM
        used = max(s.memory.required_gpu_bytes for _, s in stages) * gpus + prediction.peak_host_bytes
        assert used <= hardware.host_memory_bytes

    # The prediction's memory figures are one stage's: its host shards are that stage's chunks.
    shard_bytes = plan.memory.chunk_size // plan.data_parallel_size * SHARD_BYTES
    offloaded = [
        sum(1 for c in plan.memory.chunks if c.stage == s and c.offload) for s in range(plan.parallel.pipeline.stages)
    ]
    assert prediction.model_state_bytes["host_shard_bytes"] in [count * shard_bytes for count in offloaded]

    # Timeline: no resource busy longer than the step.
    step_s, parts = prediction.step_time_s, prediction.breakdown
    tolerance = 1e-5 * step_s + 2e-6  # the plan rounds its seconds to 6 decimals
    assert parts["allgather_s"] + parts["reduce_scatter_s"] <= step_s + tolerance
    for key in ("compute_s", "h2d_s", "d2h_s", "optimizer_cpu_s", "optimizer_gpu_s"):
        assert parts[key] <= step_s + tolerance, key

    # The search's own best: no slower than what it finds with any layout it allows pinned. Where it had one
    # layout only (the plain loop, one GPU) pinning it repeats the same exploration and ranking (seen for
    # gpt2-tiny and opt-125m over every preset and world; test_one_layout_pinned_is_the_same_search keeps
    # one), so the comparison runs where the search chose among layouts, the data-parallel pins included.
    compared = result.models if len(result.models) > 1 else []
    for layout in compared:
        pins = [f"pipeline={layout.pipeline}", f"tensor={layout.tensor}", f"context={layout.context}"]
        if layout.tensor > 1:
            pins.append(f"tensor_mode={layout.tensor_mode}")
        if layout.context > 1:
            pins.append(f"context_mode={layout.context_mode}")
        try:
            pinned = run_search(profile, hardware, nodes, gpus, loop, fixed=pins)
        except (InfeasibleError, ValueError):
            continue
        assert best.step_time_s <= pinned.candidates[0].step_time_s + EPS_S, layout.describe()
        assert prediction.step_time_s <= pinned.plan.prediction.step_time_s + EPS_S, layout.describe()


def test_one_layout_pinned_is_the_same_search():
    """With one layout to search (the plain loop on one GPU), pinning it gives the free search's ranking:
    why the grid above compares with pinned searches only where the search had several layouts."""
    hardware, profile = load_hardware("a100-40gb-pcie"), profile_of("gpt2-tiny")
    free = run_search(profile, hardware, 1, 1, "plain")
    (layout,) = free.models
    pinned = run_search(profile, hardware, 1, 1, "plain", fixed=[f"pipeline={layout.pipeline}", "tensor=1"])
    assert [c.step_time_s for c in pinned.candidates] == [c.step_time_s for c in free.candidates]
    assert pinned.plan.prediction.step_time_s == free.plan.prediction.step_time_s
