"""FSDP2 from a plan: the settings (``fsdp2_settings``), a setup file for torchtitan-style launches
(``fsdp2_setup_file``) and an accelerate config (``accelerate_config``). Imports no torch.

An fsdp2 plan maps one to one. A deepspeed plan maps to resharding after forward at stage 3 and
offload of every unit when it offloads. A plan for our own chunk engine maps to resharding (its
chunks are gathered on demand and released) and, with an offload share s, offload of the first
ceil(s x units) units: FSDP2 offloads whole units (parameters, gradients and the optimizer step),
our engine a share of the chunks' fp32 state only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elixir_tune.plan import Plan


@dataclass
class Fsdp2Settings:
    """What FSDP2 gets from a plan.

    Attributes:
        reshard_after_forward: free each unit's gathered parameters after its forward.
        offload_units: units (the root first, then the blocks) whose state lives on the host.
        units: one per block plus the root.
        notes: what of the plan FSDP2 does not express.
    """

    reshard_after_forward: bool
    offload_units: int
    units: int
    notes: list[str]


def fsdp2_settings(plan: Plan) -> Fsdp2Settings:
    """FSDP2's settings for ``plan`` and what it cannot express."""
    engine, memory = plan.engine, plan.memory
    units = plan.model.num_blocks + 1
    notes: list[str] = []
    if engine.name == "fsdp2":
        offload = 0 if not engine.offload_params else min(engine.offload_units or units, units)
        return Fsdp2Settings(engine.reshard_after_forward, offload, units, notes)
    if engine.name == "deepspeed":
        if engine.offload_optimizer != engine.offload_params:
            notes.append("optimizer offload without parameter offload: FSDP2 offloads both or neither (written: both)")
        notes.append("bucket and live-parameter sizes: FSDP2 gathers one unit at a time")
        offloaded = units if engine.offload_params or engine.offload_optimizer else 0
        return Fsdp2Settings(engine.zero_stage == 3, offloaded, units, notes)
    trainable = [chunk for chunk in memory.chunks if not chunk.frozen]
    share = sum(chunk.offload for chunk in trainable) / max(len(trainable), 1)
    if 0 < share < 1:
        notes.append(
            f"offload share {share:.2f} of the chunks: FSDP2 offloads whole units (written: the first "
            f"{math.ceil(share * units)} of {units})"
        )
    notes.append(
        f"the chunk cache ({memory.cache_blocks} blocks of {memory.chunk_size} elements), prefetch depth "
        f"{memory.prefetch} and resident chunks: FSDP2 gathers one unit at a time and prefetches the next"
    )
    all_resident = bool(trainable) and all(chunk.resident for chunk in trainable)
    return Fsdp2Settings(not all_resident, math.ceil(share * units), units, notes)


SETUP_TEMPLATE = '''"""FSDP2 setup for {name}, written by `elixir-tune export {source} --to fsdp2`.

Call ``apply_plan(model)`` in every rank after the process group is up (torchrun), then build the
optimizer on ``model.parameters()``. Per the plan: one ``fully_shard`` unit per block of
``{block_list}`` plus the root; micro-batch {micro} x {accum} accumulation steps x {world} ranks.
"""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

BLOCK_LIST = {block_list!r}
RESHARD_AFTER_FORWARD = {reshard}
OFFLOAD_UNITS = {offload}  # units (the root first, then the blocks) whose state lives on the host
PARAM_DTYPE = {param_dtype}  # None: fp32 compute
CHECKPOINT_EVERY = {checkpoint}  # 0: no activation checkpointing; k: blocks 0, k, 2k, ...
DEVICE_TYPE = {device!r}
MICRO_BATCH_SIZE = {micro}
GRAD_ACCUM_STEPS = {accum}


def _checkpointed(block):
    inner = block.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward


def apply_plan(model, mesh=None):
    """Shards ``model`` in place as the plan says; returns it."""
    if mesh is None:
        mesh = init_device_mesh(DEVICE_TYPE, (torch.distributed.get_world_size(),))
    blocks = list(model.get_submodule(BLOCK_LIST)) if BLOCK_LIST else []
    for index, block in enumerate(blocks):
        if CHECKPOINT_EVERY and index % CHECKPOINT_EVERY == 0:
            _checkpointed(block)
    units = [model, *blocks]
    policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPE, reduce_dtype=torch.float32 if PARAM_DTYPE else None)
    for index in reversed(range(len(units))):  # the blocks first: the root unit holds the rest
        offload = CPUOffloadPolicy(pin_memory=DEVICE_TYPE != "cpu") if index < OFFLOAD_UNITS else OffloadPolicy()
        fully_shard(units[index], mesh=mesh, reshard_after_forward=RESHARD_AFTER_FORWARD, mp_policy=policy,
                    offload_policy=offload)
    return model
'''


def fsdp2_setup_file(plan: Plan, source: str) -> tuple[str, list[str]]:
    """The text of a Python file whose ``apply_plan(model)`` shards a model as ``plan`` says, and the notes."""
    settings = fsdp2_settings(plan)
    notes = list(settings.notes)
    if plan.training.dtype == "fp16":
        notes.append("fp16: the file computes in fp16 but keeps no loss scaler; add torch.amp's GradScaler")
    param_dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(plan.training.dtype, "None")
    text = SETUP_TEMPLATE.format(
        name=plan.model.name,
        source=source,
        block_list=plan.model.block_list,
        reshard=settings.reshard_after_forward,
        offload=settings.offload_units,
        param_dtype=param_dtype,
        checkpoint=plan.training.activation_checkpointing.every,
        device=plan.cluster.device,
        micro=plan.training.micro_batch_size,
        accum=plan.training.grad_accum_steps,
        world=plan.world_size,
    )
    return text, notes


def accelerate_config(plan: Plan, block_class: str | None) -> tuple[dict, list[str]]:
    """An accelerate config (FSDP plugin, version 2) for ``plan``, and the notes.

    Args:
        plan: any plan.
        block_class: the class name of the model's blocks (auto wrap); the plan records their path
            (``model.block_list``) only.
    """
    settings = fsdp2_settings(plan)
    notes = list(settings.notes)
    if 0 < settings.offload_units < settings.units:
        notes.append(
            f"offload of the first {settings.offload_units} of {settings.units} units: accelerate offloads all or "
            "none (written: all)"
        )
    every = plan.training.activation_checkpointing.every
    if every > 1:
        notes.append(f"checkpointing every {every}. block: accelerate checkpoints every wrapped block (written: all)")
    if block_class is None:
        notes.append(
            f"fsdp_transformer_layer_cls_to_wrap: the class of the blocks in {plan.model.block_list}; pass "
            "--block-class (written: a placeholder)"
        )
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "num_machines": plan.cluster.nodes,
        "num_processes": plan.world_size,
        "mixed_precision": {"bf16": "bf16", "fp16": "fp16"}.get(plan.training.dtype, "no"),
        "use_cpu": plan.cluster.device == "cpu",
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": settings.reshard_after_forward,
            "fsdp_offload_params": settings.offload_units > 0,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": block_class or "SET_BLOCK_CLASS",
            "fsdp_activation_checkpointing": every > 0,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
        },
    }
    return config, notes
