"""The errors a training run raises for a problem of its inputs, not of elixir-tune (no torch here:
``import elixir_tune`` stays light)."""

from __future__ import annotations


class NonFiniteError(RuntimeError):
    """An fp32 or bf16 step's loss or gradient norm was not finite: its update was skipped (the
    weights are the last finite ones) and the run stops, naming the step and what to check."""


class ContractError(ValueError):
    """Ranks that share a data-parallel index (the ranks of one tensor or pipeline group) were fed
    different micro-batches at the first step: each rank's data slice must come from
    ``elixir_tune.data_rank()`` / ``elixir_tune.data_size()``, not RANK / WORLD_SIZE."""
