"""The DeepSpeed runner: a plan with ``engine.name: deepspeed`` runs under ``deepspeed.initialize``.

The configuration comes from the plan (export/deepspeed_config.py): the ZeRO stage, parameter and
optimizer offload to the host, bucket and live-parameter sizes, the micro-batch size and bf16/fp16.
The script keeps the plain loop's contract: it divides each micro-batch's loss by the accumulation
count and steps once per step, so DeepSpeed scales no loss and every ``optimizer.step()`` is its
accumulation boundary (``managed_gradient_accumulation`` false). ``loss.backward()`` and
``optimizer.backward(loss)`` both work (DeepSpeed hooks the loss of a plain backward).

The optimizer mapping: under ``offload_optimizer`` the user's ``torch.optim.Adam`` or ``AdamW``
becomes ``DeepSpeedCPUAdam`` with the same groups and hyperparameters (any other class is refused:
DeepSpeed's host step is its CPU Adam); otherwise DeepSpeed's ZeRO optimizer wraps the user's
optimizer itself. Clipping happens inside DeepSpeed's step: ``optimizer.clip_grad_norm`` runs the
step there with that clip and returns DeepSpeed's global norm, and the next ``optimizer.step()``
does nothing; ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` is routed there too
(engine/grad_view.py), since under ZeRO it would see no gradients (they live in its partitions). ``load_state_dict`` is refused
(ZeRO keeps its own fp32 copies): load weights into the model before ``setup``. Activation
checkpointing runs at ZeRO stages 1 and 2 only (refused at stage 3).

DeepSpeed is an optional extra (``pip install elixir-tune[deepspeed]``). On a CPU plan it runs on
its CPU accelerator (``DS_ACCELERATOR=cpu``), over the gloo group that engine/comm/ starts.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from elixir_tune.engine import grad_view
from elixir_tune.engine.comm import Comm
from elixir_tune.engine.peers.common import (
    PeerEngineError,
    PeerModel,
    PeerOptimizer,
    PeerRunner,
    apply_checkpointing,
    broadcast_weights,
)
from elixir_tune.export.deepspeed_config import deepspeed_config
from elixir_tune.plan import Plan

ADAM_CLASSES = (torch.optim.Adam, torch.optim.AdamW)


def import_deepspeed(device_type: str) -> Any:
    """DeepSpeed, on its CPU accelerator for a CPU plan.

    Raises:
        PeerEngineError: DeepSpeed is not installed.
    """
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when DeepSpeed first picks its accelerator
    try:
        import deepspeed
    except ImportError as exc:
        raise PeerEngineError(
            f"engine deepspeed: DeepSpeed is not installed ({exc}); pip install 'elixir-tune[deepspeed]' "
            "or search a plan for engine fsdp2 or elixir"
        ) from exc
    return deepspeed


def map_optimizer(optimizer: torch.optim.Optimizer, plan: Plan) -> torch.optim.Optimizer:
    """The optimizer DeepSpeed steps: DeepSpeedCPUAdam for Adam/AdamW under optimizer offload, else the user's.

    Raises:
        PeerEngineError: optimizer offload with another class, or Adam options CPU Adam lacks.
    """
    if not plan.engine.offload_optimizer:
        return optimizer
    if type(optimizer) not in ADAM_CLASSES:
        raise PeerEngineError(
            f"engine deepspeed with offload_optimizer steps on the host with DeepSpeedCPUAdam, which replaces "
            f"torch.optim.Adam or AdamW only, not {type(optimizer).__name__}; use Adam/AdamW or a plan without "
            "optimizer offload"
        )
    for group in optimizer.param_groups:
        unsupported = [key for key in ("amsgrad", "maximize", "capturable") if group.get(key)]
        if unsupported:
            raise PeerEngineError(f"engine deepspeed: DeepSpeedCPUAdam has no {', '.join(unsupported)}")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    groups = [dict(group) for group in optimizer.param_groups]
    for group in groups:
        for key in (
            "foreach",
            "fused",
            "differentiable",
            "capturable",
            "maximize",
            "amsgrad",
            "decoupled_weight_decay",
        ):
            group.pop(key, None)
    return DeepSpeedCPUAdam(groups, adamw_mode=isinstance(optimizer, torch.optim.AdamW))


def _fp32_cpu(value: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy, floating point in fp32 (integer buffers keep their dtype)."""
    dtype = torch.float32 if value.is_floating_point() else value.dtype
    return value.detach().to("cpu", dtype, copy=True)


class DeepSpeedRunner(PeerRunner):
    """The DeepSpeed engine around the user's module."""

    name = "deepspeed"

    def __init__(self, plan: Plan, comm: Comm, module: torch.nn.Module, ds_engine: Any, deepspeed: Any):
        super().__init__(plan, comm, module)
        self.ds_engine = ds_engine
        self.deepspeed = deepspeed

    def call(self, *args: Any, **kwargs: Any) -> Any:
        return self.ds_engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds_engine.backward(loss, scale_wrt_gas=False)  # the script scaled it

    def full_state_dict(self, all_ranks: bool) -> dict[str, torch.Tensor]:
        params = list(self.module.parameters())
        if self.plan.engine.zero_stage == 3:  # gather every partition, on every rank (a collective)
            with self.deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                state = {k: _fp32_cpu(v) for k, v in self.module.state_dict().items()}
        else:  # stages 1-2 keep whole weights in the module (in bf16 runs: the bf16 copy, upcast)
            state = {k: _fp32_cpu(v) for k, v in self.module.state_dict().items()}
        return state if all_ranks or self.comm.rank == 0 else {}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise self.refuse(
            "load_state_dict", "ZeRO keeps its own fp32 copies: load the weights into the model before setup"
        )


class DeepSpeedOptimizer(PeerOptimizer):
    """DeepSpeed's step behind the chunk engine's optimizer methods."""

    def __init__(self, optimizer: torch.optim.Optimizer, runner: DeepSpeedRunner):
        super().__init__(optimizer, runner, step=self._engine_step)
        self.ds_runner = runner
        self._stepped = False  # clip_grad_norm ran this step's update already
        self.trainable_params = 0  # how many parameters torch's clip_grad_norm_ must be given (grad_view)

    def _engine_step(self) -> None:
        if self._stepped:
            self._stepped = False
            return
        self.ds_runner.ds_engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ds_runner.ds_engine.zero_grad()

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Runs DeepSpeed's step with its gradients clipped to ``max_norm`` (the global 2-norm); returns
        that norm. The next ``step()`` does nothing (DeepSpeed clips only inside its step)."""
        if norm_type != 2.0:
            raise PeerEngineError(f"engine deepspeed clips by the 2-norm only, not norm_type {norm_type}")
        engine = self.ds_runner.ds_engine
        zero = engine.optimizer
        if not hasattr(zero, "clip_grad"):
            raise PeerEngineError("engine deepspeed: this ZeRO optimizer takes no clip; clip in the configuration")
        saved = zero.clip_grad
        zero.clip_grad = float(max_norm) if max_norm != float("inf") else 0.0
        try:
            engine.step()
        finally:
            zero.clip_grad = saved
        self._stepped = True
        return torch.tensor(float(engine.get_global_grad_norm()))

    def clip_grad_value(self, clip_value: float) -> None:
        raise self.ds_runner.refuse("clipping by value", "DeepSpeed clips by the global norm: use clip_grad_norm")

    def state_dict(self) -> dict:
        raise self.ds_runner.refuse("optimizer.state_dict", "save with DeepSpeed's own engine.save_checkpoint")


def setup_deepspeed(model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan: Plan, comm: Comm):
    """Runs ``model`` and ``optimizer`` under ``deepspeed.initialize`` with the plan's configuration.

    Returns:
        (PeerModel, DeepSpeedOptimizer).
    """
    if plan.engine.zero_stage == 3 and plan.training.activation_checkpointing.every > 0:
        # Measured here: a recomputed block under ZeRO-3 meets parameters it has released already.
        raise PeerEngineError(
            "engine deepspeed: activation checkpointing at zero_stage 3 is not supported by this runner "
            "(ZeRO-3 releases the parameters the recomputation reads); use zero_stage 1 or 2, or engine fsdp2"
        )
    deepspeed = import_deepspeed(comm.device.type)
    broadcast_weights(model, comm)
    apply_checkpointing(model, plan)
    stepped = map_optimizer(optimizer, plan)
    config = deepspeed_config(plan, runner=True)
    ds_engine, _, _, _ = deepspeed.initialize(model=model, optimizer=stepped, config=config)
    if stepped is not optimizer:
        optimizer.param_groups = stepped.param_groups  # a scheduler on the user's optimizer sets the lr stepped
    runner = DeepSpeedRunner(plan, comm, model, ds_engine, deepspeed)
    wrapped = DeepSpeedOptimizer(stepped, runner)
    # ZeRO holds the gradients in its partitions (p.grad stays None): torch.nn.utils.clip_grad_norm_ of
    # the model's parameters would clip nothing without a word; it goes to DeepSpeed's clip instead.
    trainable = [p for p in model.parameters() if p.requires_grad]
    wrapped.trainable_params = len(trainable)
    grad_view.register(wrapped, trainable)
    return PeerModel(model, runner), wrapped
