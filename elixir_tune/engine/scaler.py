"""Dynamic loss scaling for fp16: the scale grows after a run of good steps and shrinks on overflow.

The scale and the count of good steps are tensors on the device and the overflow decision is a
device tensor too (``torch._amp_update_scale_``, what torch.amp.GradScaler uses), so a training
step never waits for the device to learn whether it overflowed. Reading ``scale`` synchronizes.
"""

from __future__ import annotations

import torch


class DynamicLossScaler:
    """Loss scale with the usual dynamics (torch.amp.GradScaler's defaults).

    Args:
        device: where the scale lives (the compute device).
        init_scale: starting scale.
        growth_factor: multiplier after ``growth_interval`` steps without overflow.
        backoff_factor: multiplier on overflow.
        growth_interval: good steps between growths.
        min_scale: the scale never goes below this.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ):
        self.scale_tensor = torch.full((), float(init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale

    @property
    def scale(self) -> float:
        return float(self.scale_tensor)

    @property
    def good_steps(self) -> int:
        return int(self.growth_tracker)

    def update(self, found_inf: torch.Tensor) -> None:
        """Adjusts the scale after a step (``found_inf``: 1.0 when the step was skipped), on the device."""
        torch._amp_update_scale_(
            self.scale_tensor,
            self.growth_tracker,
            found_inf.to(self.scale_tensor.device, torch.float32),
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )
        self.scale_tensor.clamp_(min=self.min_scale)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale_tensor.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["good_steps"]))
