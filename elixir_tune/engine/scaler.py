"""Dynamic loss scaling for fp16: the scale grows after a run of good steps and shrinks on overflow."""

from __future__ import annotations


class DynamicLossScaler:
    """Loss scale with the usual dynamics (torch.amp.GradScaler's defaults).

    Args:
        init_scale: starting scale.
        growth_factor: multiplier after ``growth_interval`` steps without overflow.
        backoff_factor: multiplier on overflow.
        growth_interval: good steps between growths.
        min_scale: the scale never goes below this.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ):
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        """Adjusts the scale after a step (``overflow``: the step was skipped)."""
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
