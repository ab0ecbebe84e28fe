"""Stops an fp32 or bf16 run at the first step whose loss or gradient norm is not finite.

fp16 skips such a step and lowers its loss scale (``scaler.py``): an overflow there is expected
and recovers. In fp32 and bf16 nothing recovers it: training on would turn every weight into NaN
and a later save would overwrite a good checkpoint. The optimizer folds a flag of the step's losses
into the global gradient-norm all-reduce (one collective, every rank gets the same answer), skips
the update on the device when the norm or a loss is not finite (the fused kernels' ``found_inf``,
as fp16 does), and hands the two values to ``FiniteGuard``:

* on the CPU, reading them costs nothing: ``NonFiniteError`` is raised at the end of that step;
* on a GPU, reading them at once would make every step wait for the device. The two values are
  copied to pinned host memory without blocking and read at the start of the next
  ``optimizer.step`` (long since copied: that step's forward and backward ran in between), and
  before a checkpoint, ``state_dict`` or ``save_pretrained`` (which wait for the device anyway).
  The step in between trains on the unchanged, finite weights and is not applied either.

Every rank reads the same all-reduced values at the same call, so all ranks raise together.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from elixir_tune.device import DeviceOps, ops_for
from elixir_tune.engine.comm import is_dtensor
from elixir_tune.errors import NonFiniteError


def nonfinite_count(loss: torch.Tensor) -> torch.Tensor:
    """How many of ``loss``'s values are not finite, a float tensor on its device. A vocabulary-parallel
    loss (a DTensor) is read on this rank alone: no collective, and every rank counts its own."""
    local = loss.detach()
    if is_dtensor(local):
        local = local.to_local()
    return (~torch.isfinite(local.float())).float().sum()


class FiniteGuard:
    """The pending non-finite check of an fp32 or bf16 run (one step at a time).

    Args:
        device: the compute device (where the flags live).
        dtype: the plan's training dtype, named in the message.
        ops: the device's events and pinned memory; default ``ops_for(device)``.
    """

    def __init__(self, device: torch.device, dtype: str, ops: DeviceOps | None = None):
        self.device = torch.device(device)
        self.ops = ops if ops is not None else ops_for(self.device)
        self.dtype = dtype
        # Sum over the step's losses of "this loss is not finite", on the device (no host read).
        self.loss_flags = torch.zeros((), dtype=torch.float32, device=self.device)
        self._pending: tuple[int, torch.Tensor, Any] | None = None  # (step, host copy [norm, flags], event)
        self._host: torch.Tensor | None = None
        self.failed: NonFiniteError | None = None

    def note_loss(self, loss: torch.Tensor) -> None:
        """Counts a loss of this step that is not finite (on the device; under no_grad nothing)."""
        if torch.is_grad_enabled():
            self.loss_flags += nonfinite_count(loss).to(self.device)

    def record(self, step: int, norm: torch.Tensor, loss_flags: torch.Tensor) -> None:
        """The step's global gradient norm and non-finite loss count (both all-reduced).

        Raises:
            NonFiniteError: on the CPU, at once when either is not finite.
        """
        values = torch.stack([norm.detach().float().reshape(()), loss_flags.float().reshape(())])
        self.loss_flags.zero_()
        if not self.ops.streams:
            self._pending = (step, values, None)
            self.check()
            return
        if self._host is None:
            self._host = self.ops.host_empty(2, torch.float32)
        self._host.copy_(values, non_blocking=True)
        self._pending = (step, self._host, self.ops.record_event())

    def check(self) -> None:
        """Raises for a recorded step that was not finite (waits for its copy: long done at the next step).

        Raises:
            NonFiniteError: that step's loss or gradient norm was not finite, or an earlier one was.
        """
        if self.failed is not None:
            raise self.failed
        if self._pending is None:
            return
        step, values, event = self._pending
        self._pending = None
        self.ops.sync_event(event)
        norm, loss_flags = (float(v) for v in values.tolist())
        if loss_flags == 0 and math.isfinite(norm):
            return
        self.failed = NonFiniteError(self.message(step, norm, int(loss_flags)))
        raise self.failed

    def message(self, step: int, norm: float, bad_losses: int) -> str:
        what = "a micro-batch loss not finite" if bad_losses else "the losses finite"
        dtype_hint = {
            "bf16": "bf16 has fp32's range but an 8-bit mantissa: run it in fp32 to see whether the dtype is the cause",
            "fp32": "fp32 overflows only near 3e38: the learning rate or the data is the likelier cause",
        }.get(self.dtype, self.dtype)
        return (
            f"optimizer step {step} (counted from 1) is not finite in {self.dtype}: gradient norm {norm}, {what} "
            "(over all ranks). Its update was skipped and the weights are those before it; the run stops here "
            "(save_checkpoint, save_pretrained and state_dict refuse from now on). Check the learning rate (too high diverges: lower it or warm up longer), the data "
            "(a NaN/inf input, token ids outside the vocabulary, a micro-batch whose labels are all ignored) and "
            f"the dtype ({dtype_hint})"
        )
