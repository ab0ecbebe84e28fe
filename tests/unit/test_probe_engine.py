"""The probe's engine-measured layout costs (cli/probe_engine.py): the fit of a fixed cost to a measured
step, checked against the cost model itself (no workers: those run in tests/cli/test_probe_cli.py)."""

from __future__ import annotations

import dataclasses

import pytest

from elixir_tune.cli.probe_engine import (
    FIXED_FIELDS,
    LAYOUT_PINS,
    _plan,
    _with_fixed,
    fit_fixed_costs,
    fixed_cost_s,
    layout_plans,
)
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware.presets import load_hardware


def test_fixed_cost_is_the_missing_time_over_the_slope():
    # The prediction grows 4 ms per ms of fixed cost; 20 ms are missing: 5 ms.
    assert fixed_cost_s(0.050, 0.030, 0.034) == pytest.approx(0.005)
    assert fixed_cost_s(0.020, 0.030, 0.034) == 0.0  # faster than predicted without it: none
    with pytest.raises(ValueError, match="does not grow"):
        fixed_cost_s(0.050, 0.030, 0.030)


def test_the_fit_recovers_the_fixed_costs_that_produced_the_steps():
    profile = gpt2_profile("probe", hidden=32, layers=4, heads=2, vocab=256, positions=8, seq_len=8)
    spec = load_hardware("cpu")
    truth = {"pipeline_stage_microbatch_s": 0.004, "tensor2_block_fixed_s": 0.012}
    plans = layout_plans(profile, spec)
    assert plans["pipeline2"].parallel.pipeline.stages == 2 and plans["tensor2"].parallel.tensor.degree == 2
    assert plans["pipeline2"].training.grad_accum_steps == 4  # the benchmark's 4 micro-batches through the pipeline
    # The steps an engine would take if these fixed costs were all the cost model missed.
    measured = {"data": plans["data"].prediction.step_time_s}
    for name, field in FIXED_FIELDS.items():
        pins = {**LAYOUT_PINS[name], "chunk_size": plans[name].memory.chunk_size, "cache_blocks": "all", "offload": 0.0}
        pins.update(checkpointing="none", dtype="fp32", accumulation=plans[name].training.accumulation)
        measured[name] = _plan(profile, _with_fixed(spec, {field: truth[field]}), pins).prediction.step_time_s
        assert measured[name] > plans[name].prediction.step_time_s
    fitted = fit_fixed_costs(profile, spec, plans, measured, steps=5)
    assert "data parallelism alone" in fitted.sources["pipeline_stage_microbatch_s"]
    # The quick probe's: the two layouts alone, the same fit, no check in the sources.
    quick = {name: plans[name] for name in FIXED_FIELDS}
    assert set(layout_plans(profile, spec, check=False)) == set(quick)
    quick_fit = fit_fixed_costs(profile, spec, quick, measured, steps=5)
    assert quick_fit.pipeline_stage_microbatch_s == fitted.pipeline_stage_microbatch_s
    assert quick_fit.tensor2_block_fixed_s == fitted.tensor2_block_fixed_s
    assert "data parallelism alone" not in quick_fit.sources["pipeline_stage_microbatch_s"]
    assert fitted.pipeline_stage_microbatch_s == pytest.approx(truth["pipeline_stage_microbatch_s"], rel=1e-6)
    assert fitted.tensor2_block_fixed_s == pytest.approx(truth["tensor2_block_fixed_s"], rel=1e-6)
    for field in FIXED_FIELDS.values():
        assert fitted.sources[field].startswith("measured with the engine")
    # Everything else is the probe's.
    assert fitted.tensor2_block_extra_ratio == spec.tensor2_block_extra_ratio
    assert fitted.matmul_tflops == spec.matmul_tflops


def test_the_tensor_fit_does_not_depend_on_the_collective_latency():
    # Under load the probe's collective latency came out 1.6 ms, 4.9 ms and 77 ms in three runs; with the
    # split's 30 collectives priced at it, the same engine step fitted a fixed cost of 24 ms, 5 ms and 0
    # (clamped). They are inside the fixed cost now: the fit is the step less the compute, per block.
    profile = gpt2_profile("probe", hidden=32, layers=4, heads=2, vocab=256, positions=8, seq_len=8)
    fits = []
    for latency_s in (0.0016, 0.0049, 0.077):
        spec = dataclasses.replace(load_hardware("cpu"), collective_latency_s=latency_s)
        plans = layout_plans(profile, spec, check=False)
        measured = {"pipeline2": 0.060, "tensor2": 0.160}
        fits.append(fit_fixed_costs(profile, spec, plans, measured, steps=5).tensor2_block_fixed_s)
    assert min(fits) > 0.03
    assert max(fits) == pytest.approx(min(fits), rel=1e-6)
