"""The probe's steadier statistics (hardware/timing.py): a fixed cost from paired runs, spreads in the sources."""

from __future__ import annotations

import pytest

from elixir_tune.cli.probe_engine import LAYOUT_PINS, fit_fixed_costs, layout_plans
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware.presets import load_hardware
from elixir_tune.hardware.timing import median_paired_extra_s, quartiles_note


def test_a_load_change_between_pairs_cancels_out_of_the_paired_extra():
    # The collective adds 2 ms to every pair; the machine gets busy (block 10 -> 30 ms) during the third
    # pair, between its two runs. The difference of the two medians reads 22 ms; the pairs read 2.
    alone = [0.010, 0.010, 0.010, 0.030, 0.030]
    gather = [0.012, 0.012, 0.032, 0.032, 0.032]
    assert sorted(gather)[2] - sorted(alone)[2] == pytest.approx(0.022)
    assert median_paired_extra_s(alone, gather) == pytest.approx(0.002)


def test_one_slow_pair_does_not_move_the_paired_extra_and_it_is_never_negative():
    alone = [0.010, 0.011, 0.010, 0.012, 0.010]
    gather = [0.012, 0.013, 0.012, 0.050, 0.012]  # one pair hit by a context switch
    assert median_paired_extra_s(alone, gather) == pytest.approx(0.002)
    assert median_paired_extra_s([0.010, 0.010], [0.009, 0.009]) == 0.0


def test_the_paired_extra_needs_matching_pairs():
    with pytest.raises(ValueError, match="same number"):
        median_paired_extra_s([0.01, 0.02], [0.01])
    with pytest.raises(ValueError, match="same number"):
        median_paired_extra_s([], [])


def test_quartiles_note_states_centre_spread_and_count():
    assert quartiles_note([0.100, 0.200, 0.300, 0.400, 0.500]) == "median 300 (quartiles 200-400) ms of 5"
    assert quartiles_note([0.25]) == "250 ms of 1"


def test_the_engine_fit_records_how_its_steps_spread():
    profile = gpt2_profile("probe", hidden=32, layers=4, heads=2, vocab=256, positions=8, seq_len=8)
    spec = load_hardware("cpu")
    plans = layout_plans(profile, spec, check=False)
    assert set(plans) == {"pipeline2", "tensor2"} and set(plans) <= set(LAYOUT_PINS)
    measured = {"pipeline2": 0.060, "tensor2": 0.160}
    spreads = {"pipeline2": quartiles_note([0.058, 0.060, 0.065]), "tensor2": quartiles_note([0.150, 0.160, 0.190])}
    fitted = fit_fixed_costs(profile, spec, plans, measured, steps=3, spreads=spreads)
    assert fitted.sources["tensor2_block_fixed_s"].endswith("the steps: median 160 (quartiles 155-175) ms of 3")
    assert "the steps: median 60" in fitted.sources["pipeline_stage_microbatch_s"]
    # Without spreads the fit is the same and says nothing of them.
    plain = fit_fixed_costs(profile, spec, plans, measured, steps=3)
    assert plain.tensor2_block_fixed_s == fitted.tensor2_block_fixed_s
    assert "the steps:" not in plain.sources["tensor2_block_fixed_s"]
