"""fp16's stop rule (recipes/fp16_watch.py) on its two triggers: the loss not finite N steps in a row, and every
step skipped with the loss scale at its floor. The optimizer here is a record of the two numbers it reports."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from elixir_tune.engine.scaler import DynamicLossScaler
from elixir_tune.errors import NonFiniteError
from elixir_tune.recipes.fp16_watch import NONFINITE_STEPS_LIMIT, Fp16Watch


@dataclass
class Reported:
    """What the sharded optimizer reports after a step: its skipped-step count and loss scale (and its
    real scaler, whose floor the watch reads)."""

    skipped_steps: int = 0
    loss_scale: float = 65536.0
    scaler: DynamicLossScaler = field(default_factory=lambda: DynamicLossScaler(torch.device("cpu")))


def test_a_few_skipped_steps_while_the_scale_settles_are_no_fault():
    optimizer = Reported()
    watch = Fp16Watch(optimizer)
    for step in range(1, 20):
        if step <= 5:  # overflow: skipped, the scale halves (a normal fp16 start)
            optimizer.skipped_steps += 1
            optimizer.loss_scale /= 2
        assert watch.after_step(step, 5.0) == (step <= 5)


def test_a_nan_loss_for_n_steps_in_a_row_stops_and_names_them():
    watch = Fp16Watch(Reported())
    assert watch.after_step(1, 5.5) is False
    for step in range(2, 2 + NONFINITE_STEPS_LIMIT - 1):
        assert watch.after_step(step, math.nan) is True
    watch.after_step(10, 5.0)  # a finite step in between starts the count again
    for step in range(11, 11 + NONFINITE_STEPS_LIMIT - 1):
        watch.after_step(step, math.inf)
    with pytest.raises(NonFiniteError, match=r"fp16 steps 11-13 \(counted from 1\) did not train: the loss was inf"):
        watch.after_step(13, math.inf)


def test_skipping_every_step_at_the_scale_floor_stops():
    optimizer = Reported(loss_scale=1.0)
    watch = Fp16Watch(optimizer)
    for step in range(1, NONFINITE_STEPS_LIMIT):
        optimizer.skipped_steps += 1
        assert watch.after_step(step, 4.0) is True
    optimizer.skipped_steps += 1
    with pytest.raises(NonFiniteError, match=r"every step overflowed with the loss scale at its floor \(1\)"):
        watch.after_step(NONFINITE_STEPS_LIMIT, 4.0)
