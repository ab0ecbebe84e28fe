"""Which training engine runs a plan (``engine``): our chunk engine, PyTorch FSDP2 or DeepSpeed ZeRO.

A plan made for our own engine has no ``engine`` section and reads as before. A plan for a peer
engine names it and the few settings of that engine the search chooses; the ``memory`` section
then records the model's parameter order, and the per-chunk offload and cache choices, which
the peers cannot express, must stay at their defaults (``engine_problems``). The runners live in
``engine/peers/``; ``elixir-tune export`` writes each engine's own configuration from these
fields. Imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from elixir_tune.plan.fields import PositiveInt

EngineName = Literal["elixir", "fsdp2", "deepspeed"]
ENGINE_NAMES: tuple[str, ...] = get_args(EngineName)
ZeroStage = Literal[1, 2, 3]


@dataclass
class EngineChoice:
    """The engine a plan runs on, and that engine's settings.

    Attributes:
        name: ``elixir`` (the chunk engine, configured by ``memory``), ``fsdp2`` (PyTorch's
            ``fully_shard``, one unit per block plus the root) or ``deepspeed`` (ZeRO, an
            optional extra).
        zero_stage: DeepSpeed's ZeRO stage (1: optimizer states sharded, 2: and gradients,
            3: and parameters). FSDP2 is stage 3 with ``reshard_after_forward`` and behaves as
            stage 2 without it.
        reshard_after_forward: FSDP2 frees each unit's gathered parameters after its forward
            and gathers them again for backward (less memory, one more all-gather per unit).
        offload_params: parameters live on the host (FSDP2's ``CPUOffloadPolicy``, which also
            keeps gradients and runs the optimizer step there; DeepSpeed's ``offload_param``,
            stage 3 only).
        offload_optimizer: optimizer states and step on the host (DeepSpeed's
            ``offload_optimizer`` with its CPU Adam). FSDP2 cannot split the two: it must equal
            ``offload_params``.
        offload_units: FSDP2 only: offload just the first N of its units in forward order
            (None: all units when ``offload_params``). Each ``fully_shard`` unit takes its own
            offload policy, so a share of the model can stay on the device.
        reduce_bucket_elements: DeepSpeed's ``reduce_bucket_size`` (None: its default).
        prefetch_bucket_elements: DeepSpeed's ``stage3_prefetch_bucket_size`` (None: its default).
        max_live_elements: DeepSpeed's ``stage3_max_live_parameters`` (None: its default).
    """

    name: EngineName = "elixir"
    zero_stage: ZeroStage = 3
    reshard_after_forward: bool = True
    offload_params: bool = False
    offload_optimizer: bool = False
    offload_units: PositiveInt | None = None
    reduce_bucket_elements: PositiveInt | None = None
    prefetch_bucket_elements: PositiveInt | None = None
    max_live_elements: PositiveInt | None = None


def changed_fields(value: object, default: object) -> dict[str, object]:
    """The fields of dataclass ``value`` that differ from ``default``'s, in declaration order."""
    return {
        field.name: getattr(value, field.name)
        for field in dataclasses.fields(value)  # type: ignore[arg-type]
        if getattr(value, field.name) != getattr(default, field.name)
    }


_FSDP2_ONLY = ("reshard_after_forward", "offload_units")
_DEEPSPEED_ONLY = ("zero_stage", "reduce_bucket_elements", "prefetch_bucket_elements", "max_live_elements")


def engine_problems(engine: dict, memory: dict, parallel: dict) -> list[str]:
    """Every reason the named engine cannot run the plan as written, each with its field path.

    Args:
        engine: the plan's ``engine`` mapping (fields already type-checked).
        memory: the plan's ``memory`` mapping.
        parallel: the plan's ``parallel`` mapping.

    Returns:
        The problems; empty for our own engine's plans and for peer plans that run.
    """
    name = engine.get("name", "elixir")
    defaults = EngineChoice()
    set_fields = [key for key, value in engine.items() if key != "name" and value != getattr(defaults, key)]
    if name == "elixir":
        return [f"engine.{key}: is a setting of fsdp2 or deepspeed, not of engine elixir" for key in set_fields]
    other_only = _DEEPSPEED_ONLY if name == "fsdp2" else _FSDP2_ONLY
    problems = [f"engine.{key}: is not a setting of engine {name}" for key in set_fields if key in other_only]
    if name == "fsdp2" and engine.get("offload_optimizer", False) != engine.get("offload_params", False):
        problems.append(
            "engine.offload_optimizer: FSDP2's CPUOffloadPolicy moves parameters, gradients and the optimizer "
            "step together; set offload_optimizer equal to offload_params"
        )
    if name == "fsdp2" and engine.get("offload_units") is not None and not engine.get("offload_params", False):
        problems.append("engine.offload_units: set only with offload_params: true")
    if name == "deepspeed" and engine.get("offload_params", False) and engine.get("zero_stage", 3) != 3:
        problems.append("engine.offload_params: DeepSpeed offloads parameters at zero_stage 3 only")
    layouts = [key for key in ("pipeline", "tensor", "context", "expert") if _degree(parallel.get(key, {})) > 1]
    if layouts:
        problems.append(
            f"engine.name: {name} runs data-parallel plans only, not {', '.join(layouts)} parallelism; "
            "use engine elixir for them"
        )
    chunked = [
        key
        for chunk in memory.get("chunks", []) or []
        if isinstance(chunk, dict)
        for key in ("offload", "resident")
        if chunk.get(key)
    ]
    if chunked:
        problems.append(
            f"memory.chunks: per-chunk {' and '.join(sorted(set(chunked)))} choices are the chunk engine's; "
            f"engine {name} takes its offload from engine.offload_params / offload_optimizer"
        )
    return problems


def _degree(section: object) -> int:
    """A layout's degree (pipeline counts stages) from its mapping; 1 when absent or malformed."""
    if not isinstance(section, dict):
        return 1
    value = section.get("stages", section.get("degree", 1))
    return value if isinstance(value, int) else 1
