"""The model wrapper that ``setup`` returns: the user's module, driven by the engine."""

from __future__ import annotations

import torch

from elixir_tune.engine.engine import Engine


class ElixirModel(torch.nn.Module):
    """Wraps the user's module; call it exactly like the module.

    Attributes:
        module: the user's module (its chunked parameters hold data only while in use).
        engine: the Engine (chunks, cache, hooks).
    """

    def __init__(self, module: torch.nn.Module, engine: Engine):
        super().__init__()
        self.module = module
        object.__setattr__(self, "engine", engine)  # not a submodule: keep it out of modules()

    def forward(self, *args, **kwargs):
        self.engine.begin_forward()
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)  # e.g. model.config

    def state_dict(self, *args, all_ranks: bool = False, **kwargs) -> dict[str, torch.Tensor]:
        """Full fp32 weights with the original names, frozen parameters and buffers included (on the CPU).

        A collective: every rank must call it. Rank 0 gets the full dictionary and the other ranks an
        empty one, unless ``all_ranks`` (then every rank holds the whole model at once).
        """
        return self.engine.full_state_dict(all_ranks=all_ranks)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads full weights (original names, as ``state_dict`` returns) into the shards."""
        self.engine.load_full_state_dict(state_dict)

    def memory_report(self) -> dict[str, int]:
        """Model-state bytes of this rank (keys ``elixir_tune.plan.MODEL_STATE_KEYS``)."""
        return self.engine.memory_report()
