"""Stops an fp16 run that no longer trains, before it saves or reports it as done.

fp32 and bf16 stop at the first non-finite step (engine/finite.py). fp16 skips an overflowing step and
halves its loss scale, which is how fp16 recovers from a too-large scale, so one skipped step is no
fault. Two things are past recovery, and a run that goes on would save unchanged weights every step as
progress and exit 0 ("loss 5.5 -> nan"):

* the loss itself is not finite for ``NONFINITE_STEPS_LIMIT`` steps in a row: the forward overflows
  (the loss scale acts on the backward only, so no scale can fix it);
* every one of the last ``NONFINITE_STEPS_LIMIT`` steps was skipped with the scale at its floor: there
  is no lower scale left to try.

The loss the loop reads is all-reduced, and the skip count is the optimizer's (the same on every rank),
so every rank stops at the same step.
"""

from __future__ import annotations

import math

from elixir_tune.errors import NonFiniteError

# Steps in a row: a legitimate run may skip a step or two while its scale settles; three with a
# non-finite loss, or at the floor of the scale, is divergence.
NONFINITE_STEPS_LIMIT = 3


class Fp16Watch:
    """The run of bad fp16 steps so far.

    Args:
        optimizer: the sharded optimizer of an fp16 plan (``skipped_steps``, ``loss_scale``, ``scaler``).
    """

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer
        self.floor_scale = optimizer.scaler.min_scale  # the scale never goes below it (engine/scaler.py)
        self.skipped_before = int(optimizer.skipped_steps)
        self.bad_losses = 0  # steps in a row whose loss was not finite
        self.floor_skips = 0  # steps in a row skipped with the scale at its floor
        self.first_bad_step = 0

    def after_step(self, step: int, mean_loss: float) -> bool:
        """Notes one optimizer step; whether it was a bad one (the loop saves no checkpoint of a bad step).

        Args:
            step: the step just done, counted from 1.
            mean_loss: its loss, averaged over the ranks.

        Returns:
            True when the step's loss was not finite or the step was skipped.

        Raises:
            NonFiniteError: the last ``NONFINITE_STEPS_LIMIT`` steps were past recovery (on every rank).
        """
        skipped_now = int(self.optimizer.skipped_steps)  # the loop has read the loss: no extra device wait
        skipped = skipped_now > self.skipped_before
        self.skipped_before = skipped_now
        finite = math.isfinite(mean_loss)
        if finite and not skipped:
            self.bad_losses = self.floor_skips = 0
            return False
        if self.bad_losses == 0 and self.floor_skips == 0:
            self.first_bad_step = step
        self.bad_losses = 0 if finite else self.bad_losses + 1
        at_floor = skipped and self.optimizer.loss_scale <= self.floor_scale
        self.floor_skips = self.floor_skips + 1 if at_floor else 0
        if self.bad_losses >= NONFINITE_STEPS_LIMIT or self.floor_skips >= NONFINITE_STEPS_LIMIT:
            what = (
                f"the loss was {mean_loss} (not finite) for {self.bad_losses} steps in a row"
                if self.bad_losses >= NONFINITE_STEPS_LIMIT
                else f"every step overflowed with the loss scale at its floor ({self.floor_scale:g})"
            )
            raise NonFiniteError(
                f"fp16 steps {self.first_bad_step}-{step} (counted from 1) did not train: {what}, so each was "
                "skipped and no later one can recover; the run stops without saving them. Lower the learning rate "
                "(or warm up longer), check the data, or run in bf16 or fp32 (a wider range than fp16's 65504)"
            )
        return True
