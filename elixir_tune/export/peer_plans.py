"""A plan's nearest configuration on another engine, as a plan (``on_engine``). Imports no torch.

The mapping is the one ``elixir-tune export`` writes (export/deepspeed_config.py,
export/fsdp2_setup.py): the same model, batch, precision and checkpointing; the sharding and offload
each engine can express. Per-chunk offload and residency, which the peers cannot express, are reset.
"""

from __future__ import annotations

import copy

from elixir_tune.export.deepspeed_config import zero_section
from elixir_tune.export.fsdp2_setup import fsdp2_settings
from elixir_tune.plan import Plan
from elixir_tune.plan.engine_choice import EngineChoice


def on_engine(plan: Plan, name: str) -> Plan:
    """``plan`` for engine ``name`` (elixir, fsdp2 or deepspeed).

    Raises:
        ValueError: an unknown engine, or ``elixir`` from a peer plan (the chunks would need a search).
    """
    if name == plan.engine.name:
        return copy.deepcopy(plan)
    if name == "elixir":
        raise ValueError("a peer plan has no chunk layout to run on engine elixir: search again for it")
    if name == "fsdp2":
        settings = fsdp2_settings(plan)
        offload = settings.offload_units > 0
        partial = offload and settings.offload_units < settings.units
        engine = EngineChoice(
            name="fsdp2",
            reshard_after_forward=settings.reshard_after_forward,
            offload_params=offload,
            offload_optimizer=offload,
            offload_units=settings.offload_units if partial else None,
        )
    elif name == "deepspeed":
        zero = zero_section(plan)
        engine = EngineChoice(
            name="deepspeed",
            zero_stage=zero["stage"],
            offload_params="offload_param" in zero,
            offload_optimizer="offload_optimizer" in zero,
        )
    else:
        raise ValueError(f"unknown engine {name!r}: elixir, fsdp2 or deepspeed")
    mapped = copy.deepcopy(plan)
    mapped.engine = engine
    for chunk in mapped.memory.chunks:
        chunk.offload = chunk.resident = False
    mapped.prediction = None  # the chunk engine's prediction does not hold on another engine
    return mapped
