"""The FSDP2 runner: a plan with ``engine.name: fsdp2`` runs on PyTorch's ``fully_shard``.

One ``fully_shard`` unit per block of ``model.block_list``, then the root (the embeddings, the
head and whatever else no block holds). Each unit gathers its parameters before its forward,
reduce-scatters its gradients after its backward, and frees the gathered copy after its forward
when ``engine.reshard_after_forward``. ``engine.offload_params`` keeps the units' shards, their
gradients and the optimizer step on the host (``CPUOffloadPolicy``): all units, or the first
``engine.offload_units`` in forward order (the root first, then the blocks). ``training.dtype``
bf16 computes in bf16 and reduces gradients in fp32 (``MixedPrecisionPolicy``); fp16 is refused.

The user's optimizer keeps its class, groups and hyperparameters: its groups are pointed at the
sharded parameters (DTensors), so it steps this rank's shards. Plain ``loss.backward()`` reduces
the gradients at every backward; ``forward_backward`` holds them unreduced until the step's last
micro-batch (``set_requires_gradient_sync``).

This module is torch's own distributed code (``torch.distributed.fsdp``), an exception to the
rule that only engine/comm/ calls torch.distributed (tests/unit/test_layout.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from elixir_tune.device import ops_for
from elixir_tune.engine.comm import Comm
from elixir_tune.engine.peers.common import (
    PeerModel,
    PeerOptimizer,
    PeerRunner,
    apply_checkpointing,
    broadcast_weights,
    plan_blocks,
    retarget_groups,
)
from elixir_tune.plan import Plan


def offloaded_units(plan: Plan, unit_count: int) -> int:
    """How many of the ``unit_count`` units (root first, then the blocks) keep their state on the host."""
    engine = plan.engine
    if not engine.offload_params:
        return 0
    return unit_count if engine.offload_units is None else min(engine.offload_units, unit_count)


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    """fp32: no casts; bf16: compute in bf16, reduce gradients in fp32 (the master weights stay fp32)."""
    if dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


class Fsdp2Runner(PeerRunner):
    """The user's module with ``fully_shard`` applied per the plan."""

    name = "fsdp2"

    def __init__(self, plan: Plan, comm: Comm, module: torch.nn.Module):
        super().__init__(plan, comm, module)
        self.fsdp: FSDPModule = module  # type: ignore[assignment]  # fully_shard made the root one

    def micro_batch(self, index: int, count: int) -> None:
        # Reduce once per step: the gradients of earlier micro-batches accumulate unsharded.
        self.fsdp.set_requires_gradient_sync(index == count - 1)

    def end_micro_batches(self) -> None:
        self.fsdp.set_requires_gradient_sync(True)  # a plain loop afterwards reduces at each backward

    def full_state_dict(self, all_ranks: bool) -> dict[str, torch.Tensor]:
        state = {}
        for name, value in self.module.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value  # a collective on every rank
            state[name] = full.detach().to("cpu", copy=True)
        return state if all_ranks or self.comm.rank == 0 else {}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        own = self.module.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"load_state_dict: the state lacks {', '.join(missing[:5])}")
        with torch.no_grad():
            for name, value in own.items():
                full = state[name]
                if isinstance(value, DTensor):
                    piece = distribute_tensor(full.to(value.dtype), value.device_mesh, list(value.placements))
                    value.to_local().copy_(piece.to_local())
                else:
                    value.copy_(full)


class Fsdp2Optimizer(PeerOptimizer):
    """The user's optimizer over the sharded parameters."""

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients of every rank's shards to ``max_norm`` together; returns the global norm."""
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm


def setup_fsdp2(model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan: Plan, comm: Comm):
    """Shards ``model`` with ``fully_shard`` as the plan's engine section says.

    Returns:
        (PeerModel, Fsdp2Optimizer).
    """
    broadcast_weights(model, comm)
    apply_checkpointing(model, plan)
    old_names = {id(p): name for name, p in model.named_parameters()}
    mesh = init_device_mesh(comm.device.type, (comm.world_size,))
    blocks = plan_blocks(model, plan)
    units: list[torch.nn.Module] = [model, *blocks]  # forward order: the root's gather comes first
    offloaded = offloaded_units(plan, len(units))
    policy = mixed_precision(plan.training.dtype)
    pin = ops_for(comm.device).pinned  # pinned host memory needs an accelerator (elixir_tune/device.py)
    settings: dict[str, Any] = dict(
        mesh=mesh, reshard_after_forward=plan.engine.reshard_after_forward, mp_policy=policy
    )
    # Children first: the root unit holds what no block holds.
    for index in reversed(range(len(units))):
        offload = CPUOffloadPolicy(pin) if index < offloaded else OffloadPolicy()  # its pin_memory field
        fully_shard(units[index], offload_policy=offload, **settings)
    retarget_groups(optimizer, old_names, dict(model.named_parameters()))
    runner = Fsdp2Runner(plan, comm, model)
    return PeerModel(model, runner), Fsdp2Optimizer(optimizer, runner)
