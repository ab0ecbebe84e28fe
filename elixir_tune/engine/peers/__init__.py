"""Runners of the peer engines a plan may name (``engine.name``): PyTorch FSDP2 and DeepSpeed ZeRO.

``setup_peer`` is what ``elixir_tune.setup`` calls for such a plan; each runner is imported only
then (FSDP2 and DTensor take a while to import; DeepSpeed is an optional extra).
"""

from __future__ import annotations

import torch

from elixir_tune import ranks
from elixir_tune.engine.comm import init_comm, init_group_of_one
from elixir_tune.engine.peers.common import PeerEngineError, check_peer_arguments
from elixir_tune.plan import Plan

__all__ = ["PeerEngineError", "setup_peer"]


def setup_peer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan: Plan, weights=None,
               vocab_parallel_loss: bool = False):  # fmt: skip
    """Runs ``plan`` on the engine it names (fsdp2 or deepspeed); the model and optimizer the script steps.

    Raises:
        PeerEngineError: what the chunk engine's setup takes and the peer cannot (a meta-device model,
            ``weights``, fp16 on fsdp2), or DeepSpeed is not installed.
    """
    check_peer_arguments(plan, model, weights, vocab_parallel_loss)
    if plan.world_size == 1:  # FSDP2 and DeepSpeed need a process group even alone
        init_group_of_one(plan.cluster.backend)
    comm = init_comm(plan.world_size, plan.cluster.device, plan.cluster.backend)
    ranks.use_plan(plan, comm.rank)
    if plan.engine.name == "fsdp2":
        from elixir_tune.engine.peers.fsdp2 import setup_fsdp2

        return setup_fsdp2(model, optimizer, plan, comm)
    from elixir_tune.engine.peers.deepspeed import setup_deepspeed

    return setup_deepspeed(model, optimizer, plan, comm)
