"""A DeepSpeed configuration (``ds_config.json``) from a plan, and what it cannot express. Imports no torch.

A deepspeed plan maps one to one: its ZeRO stage, parameter and optimizer offload, bucket and
live-parameter sizes. An fsdp2 plan maps to stage 3 (stage 2 without ``reshard_after_forward``)
with both offloads when it offloads. A plan for our own chunk engine maps to stage 3 (stage 2 when
every chunk stays gathered), with the optimizer on the host (``offload_optimizer``) when any chunk
is offloaded: our engine offloads a chunk's fp32 shard, gradient and optimizer state, which is
DeepSpeed's optimizer offload; it gathers the compute-dtype weights on the device, as DeepSpeed
does without ``offload_param``.
"""

from __future__ import annotations

from typing import Any

from elixir_tune.plan import Plan

NO_PRINT_STEPS = 1 << 30  # DeepSpeed logs every steps_per_print steps; a plan's run logs itself


def zero_section(plan: Plan) -> dict[str, Any]:
    """The ``zero_optimization`` section."""
    engine = plan.engine
    if engine.name == "deepspeed":
        stage, offload_params, offload_optimizer = engine.zero_stage, engine.offload_params, engine.offload_optimizer
    elif engine.name == "fsdp2":
        stage = 3 if engine.reshard_after_forward else 2
        offload_params = engine.offload_params and stage == 3  # DeepSpeed offloads parameters at stage 3 only
        offload_optimizer = engine.offload_params
    else:
        trainable = [chunk for chunk in plan.memory.chunks if not chunk.frozen]
        stage = 2 if trainable and all(chunk.resident for chunk in trainable) else 3
        offload_params = False
        offload_optimizer = any(chunk.offload for chunk in trainable)
    zero: dict[str, Any] = {"stage": stage}
    if offload_params:
        zero["offload_param"] = {"device": "cpu"}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if stage == 1:
        zero["overlap_comm"] = False  # a step-owned accumulation boundary needs it off below stage 2
    sizes = {
        "reduce_bucket_size": engine.reduce_bucket_elements,
        "stage3_prefetch_bucket_size": engine.prefetch_bucket_elements,
        "stage3_max_live_parameters": engine.max_live_elements,
    }
    zero.update({key: value for key, value in sizes.items() if value is not None})
    return zero


def deepspeed_config(plan: Plan, runner: bool = False) -> dict[str, Any]:
    """The DeepSpeed configuration that reproduces ``plan`` as far as DeepSpeed can.

    Args:
        plan: any plan (our engine's, fsdp2's or deepspeed's).
        runner: for our own runner (engine/peers/deepspeed.py), where the script divides each
            micro-batch's loss by the accumulation count and calls ``optimizer.step()`` once per step:
            DeepSpeed then scales nothing (``gradient_accumulation_steps`` 1) and the step is the
            accumulation boundary (``managed_gradient_accumulation`` false). Otherwise the
            configuration of a DeepSpeed script (``engine.backward(loss)`` and ``engine.step()`` per
            micro-batch), with the plan's accumulation steps.

    Returns:
        The configuration as a dict (JSON-ready).
    """
    training = plan.training
    accum = 1 if runner else training.grad_accum_steps
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": training.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "train_batch_size": training.micro_batch_size * accum * plan.world_size,
        "zero_optimization": zero_section(plan),
        "bf16": {"enabled": training.dtype == "bf16"},
        "fp16": {"enabled": training.dtype == "fp16"},
        # DeepSpeed clips at 1.0 unless told otherwise; a plan does not clip (the script chooses).
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": NO_PRINT_STEPS,
        "wall_clock_breakdown": False,
    }
    if runner:
        config["managed_gradient_accumulation"] = False
        # The runner maps the user's optimizer itself (DeepSpeedCPUAdam for Adam/AdamW under offload).
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def deepspeed_unexpressed(plan: Plan) -> list[str]:
    """What of ``plan`` the DeepSpeed configuration does not reproduce, one line each."""
    notes = []
    engine, memory = plan.engine, plan.memory
    if engine.name == "elixir":
        trainable = [chunk for chunk in memory.chunks if not chunk.frozen]
        share = sum(chunk.offload for chunk in trainable) / max(len(trainable), 1)
        if 0 < share < 1:
            notes.append(
                f"offload share {share:.2f} of the chunks: DeepSpeed offloads all optimizer states or none "
                "(written: all, offload_optimizer)"
            )
        resident = sum(chunk.resident for chunk in trainable)
        if resident and resident < len(trainable):
            notes.append(f"{resident} resident (always gathered) chunks: DeepSpeed has no per-parameter residency")
        notes.append(
            f"the chunk cache ({memory.cache_blocks} blocks of {memory.chunk_size} elements) and prefetch depth "
            f"{memory.prefetch}: DeepSpeed sizes its own buckets (its defaults written)"
        )
        if plan.training.accumulation == "layered":
            notes.append("layered accumulation: DeepSpeed runs micro-batches one after the other")
    if engine.name == "fsdp2" and engine.offload_units is not None:
        notes.append(
            f"offload of the first {engine.offload_units} FSDP2 units only: DeepSpeed offloads every parameter "
            "(written: all)"
        )
    if engine.name == "fsdp2" and engine.offload_params and not engine.reshard_after_forward:
        notes.append("parameter offload without resharding after forward: DeepSpeed offloads parameters at stage 3")
    if plan.training.activation_checkpointing.every > 0:
        notes.append(
            f"activation checkpointing of every {plan.training.activation_checkpointing.every}. block of "
            f"{plan.model.block_list}: apply it in the model (DeepSpeed's config does not choose modules)"
        )
    if plan.parallel.pipeline.stages > 1 or plan.parallel.tensor.degree > 1:
        notes.append("pipeline and tensor parallelism: DeepSpeed ZeRO runs the data-parallel layout only")
    return notes
