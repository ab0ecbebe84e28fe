"""What the peer engines' runners share: the model and optimizer that ``setup`` returns for them.

A peer plan (``engine.name`` fsdp2 or deepspeed) keeps the script contract of the chunk engine
where the peer can honour it: the model is called like the user's module, ``forward_backward``
runs a step's micro-batches with the same token weighting (engine/token_weights.py),
``state_dict`` gathers full fp32 weights on rank 0, and the optimizer has ``backward``,
``clip_grad_norm``, ``step`` and ``zero_grad``. What a peer cannot do is refused with a message
(``PeerEngineError``): the chunk engine's checkpoints, ``save_pretrained`` and the recipes read
``model.engine``, which a peer run does not have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from elixir_tune.engine.comm import Comm
from elixir_tune.engine.hooks import wrap_checkpointed
from elixir_tune.engine.model import LossFn, check_micro_batches, forward_keywords, keep_keywords, loss_of, with_prefix
from elixir_tune.engine.token_weights import is_causal_lm, token_weights, wants_token_weights
from elixir_tune.models.kv_cache import disable_kv_cache
from elixir_tune.plan import Plan


class PeerEngineError(RuntimeError):
    """Something the chunk engine offers that a peer engine's run does not."""


class PeerRunner:
    """One peer engine's run: how a forward, a backward and a step go through it.

    Attributes:
        name: the engine's name (``fsdp2`` or ``deepspeed``).
        plan: the plan it runs.
        comm: this rank's Comm over the whole world (every rank is a data rank).
        module: the user's module (wrapped or modified in place by the engine).
    """

    name = "peer"

    def __init__(self, plan: Plan, comm: Comm, module: torch.nn.Module):
        self.plan = plan
        self.comm = comm
        self.module = module

    def call(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def micro_batch(self, index: int, count: int) -> None:
        """Called before micro-batch ``index`` of ``count`` in ``forward_backward`` (no-sync windows)."""

    def end_micro_batches(self) -> None:
        """Called after the last micro-batch of ``forward_backward``."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def full_state_dict(self, all_ranks: bool) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def refuse(self, what: str, instead: str) -> PeerEngineError:
        """The error for a habit this engine's run does not offer."""
        return PeerEngineError(f"{what} is not available on engine {self.name} (plan engine.name); {instead}")


class PeerModel(torch.nn.Module):
    """The model ``setup`` returns for a peer plan; call it exactly like the user's module.

    Attributes:
        module: the user's module, as the peer engine holds it.
        runner: the PeerRunner.
    """

    def __init__(self, module: torch.nn.Module, runner: PeerRunner):
        super().__init__()
        self.module = module
        object.__setattr__(self, "runner", runner)  # not a submodule
        self._forward_keys: frozenset[str] | None = None

    @property
    def engine(self) -> Any:
        raise self.runner.refuse(
            "the chunk engine (model.engine: its checkpoints, save_pretrained, the recipes)",
            "save with model.state_dict() on every rank (rank 0 gets the full weights), or run engine elixir",
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.runner.call(*args, **kwargs)

    def forward_backward(
        self, micro_batches: Sequence[dict], loss_fn: LossFn | None = None, *, weight_by_tokens: bool | None = None
    ) -> torch.Tensor:
        """Forward and backward of a step's micro-batches, as ``ElixirModel.forward_backward`` (standard
        accumulation): the loss of each is weighted by its counted tokens for a causal LM's own loss,
        else 1/K; the gradients are reduced once, after the last micro-batch, where the engine can
        hold them unreduced in between (FSDP2's ``set_requires_gradient_sync``).

        Returns:
            This rank's share of the step's loss (detached, 0-dim).
        """
        check_micro_batches(micro_batches)
        module = self.runner.module
        causal = is_causal_lm(module)
        weighted = wants_token_weights(micro_batches, weight_by_tokens, loss_fn is not None, causal)
        weights = token_weights(micro_batches, self.runner.comm, shift=causal) if weighted else None
        count = len(micro_batches)
        scales = [1 / count] * count if weights is None else weights
        losses = []
        try:
            for index, batch in enumerate(micro_batches):
                self.runner.micro_batch(index, count)
                output = self.runner.call(**self._model_inputs(batch))
                loss = (loss_fn(output, batch) if loss_fn is not None else loss_of(output)) * scales[index]
                self.runner.backward(loss)
                losses.append(loss.detach())
        finally:
            self.runner.end_micro_batches()
        summed = torch.stack(losses).sum()
        return summed / (scales[0] * count) if weights is None else summed

    def _model_inputs(self, batch: dict) -> dict:
        """The micro-batch's keys the module's forward takes (all of them when it takes ``**kwargs``)."""
        if self._forward_keys is None:
            self._forward_keys = forward_keywords(self.runner.module)
        return keep_keywords(batch, self._forward_keys)

    def token_weights(self, micro_batches: Sequence[dict]) -> list[float]:
        """Each micro-batch's weight for the plain loop's token-weighted step (``ElixirModel.token_weights``)."""
        wants_token_weights(micro_batches, True, False)
        weights = token_weights(micro_batches, self.runner.comm, shift=is_causal_lm(self.runner.module))
        return weights if weights is not None else [1 / len(micro_batches)] * len(micro_batches)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)  # e.g. model.config

    def state_dict(self, *args: Any, destination=None, prefix: str = "", all_ranks: bool = False, **kwargs: Any):
        """Full fp32 weights with the original names, on the CPU: rank 0 gets them, the other ranks an
        empty dict unless ``all_ranks``. A collective: every rank calls it."""
        state = self.runner.full_state_dict(all_ranks)
        return with_prefix(state, prefix, destination)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads full weights (original names, as ``state_dict`` returns; every rank passes them)."""
        self.runner.load_full_state_dict(state_dict)

    def check_finite(self) -> None:
        """The chunk engine's non-finite check; a peer run has none to read."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.runner.module.zero_grad(set_to_none)


class PeerOptimizer(torch.optim.Optimizer):
    """The optimizer ``setup`` returns for a peer plan: the user's groups (LR schedulers work), and the
    chunk engine's optimizer methods (``backward``, ``clip_grad_norm``, ``grad_norm``).

    Args:
        optimizer: the optimizer that steps (the user's, or the one the peer engine built).
        runner: the PeerRunner.
        step: what one optimizer step runs (default ``optimizer.step``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, runner: PeerRunner, step: Callable[[], Any] | None = None):
        self.optimizer_class = type(optimizer)
        super().__init__([dict(group) for group in optimizer.param_groups], dict(optimizer.defaults))
        self.param_groups = optimizer.param_groups  # shared: a scheduler on either sets the lr
        self.state = optimizer.state
        self.user_optimizer = optimizer
        self.runner = runner
        self._step = step or optimizer.step
        self.loss_scale = 1.0
        self.skipped_steps = 0

    def backward(self, loss: torch.Tensor) -> None:
        self.runner.backward(loss)

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("step(closure) is not supported on a peer engine's optimizer; call step()")
        return self._step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.user_optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return self.user_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.user_optimizer.load_state_dict(state_dict)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        raise NotImplementedError

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        return self.clip_grad_norm(float("inf"), norm_type)


def world_comm(model: torch.nn.Module) -> Comm:
    """The Comm over every rank of what ``setup`` returned: the chunk engine's world, or a peer run's."""
    runner = getattr(model, "runner", None)
    if isinstance(runner, PeerRunner):
        return runner.comm
    engine: Any = model.engine
    return engine.mesh.world


def check_peer_arguments(plan: Plan, model: torch.nn.Module, weights, vocab_parallel_loss: bool) -> None:
    """Refuses what only the chunk engine's setup does: meta-device models, weight files, a
    vocabulary-parallel loss, fp16 (its loss scaler)."""
    name = plan.engine.name
    if weights is not None or any(p.is_meta for p in model.parameters()):
        raise PeerEngineError(
            f"engine {name}: build the model with real weights (load them before setup); a meta-device model and "
            "setup(weights=...) are the chunk engine's (engine elixir)"
        )
    if vocab_parallel_loss:
        raise PeerEngineError(f"engine {name}: vocab_parallel_loss is tensor parallelism's, which {name} plans lack")
    if plan.training.dtype == "fp16" and name == "fsdp2":
        raise PeerEngineError(
            "engine fsdp2: fp16 needs a loss scaler the fsdp2 runner does not keep; use training.dtype bf16 or fp32"
        )


def broadcast_weights(model: torch.nn.Module, comm: Comm) -> None:
    """Rank 0's parameters and buffers on every rank, as the chunk engine uses rank 0's weights: a
    peer engine shards each rank's own copy, which must then be the same everywhere."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            comm.broadcast(tensor.data, src=0)


def plan_blocks(model: torch.nn.Module, plan: Plan) -> list[torch.nn.Module]:
    """The plan's repeated blocks (``model.block_list``), in order; empty when it names none."""
    if not plan.model.block_list:
        return []
    blocks = model.get_submodule(plan.model.block_list)
    if isinstance(blocks, torch.nn.ModuleDict):  # torchtitan's layers: keys "0".."n-1"
        return list(blocks.values())
    if not isinstance(blocks, (torch.nn.ModuleList, torch.nn.Sequential)):
        raise ValueError(f"model.block_list {plan.model.block_list!r} is a {type(blocks).__name__}, not a ModuleList")
    return list(blocks)


def apply_checkpointing(model: torch.nn.Module, plan: Plan) -> None:
    """Activation checkpointing of the plan's blocks (``training.activation_checkpointing``), as the
    chunk engine applies it: every k-th block runs its forward under non-reentrant checkpointing."""
    checkpointing = plan.training.activation_checkpointing
    if checkpointing.every <= 0:
        return
    blocks = plan_blocks(model, plan)
    if not blocks:
        raise ValueError("training.activation_checkpointing is set but model.block_list names no blocks")
    disable_kv_cache(model)
    for index, block in enumerate(blocks):
        if checkpointing.applies_to(index):
            wrap_checkpointed(block)


def retarget_groups(optimizer: torch.optim.Optimizer, old_names: dict[int, str], new_params: dict[str, Any]) -> None:
    """Points the optimizer's groups at the engine's new parameter objects (by name), in place.

    Raises:
        PeerEngineError: the optimizer has state already (it stepped before setup), or holds a
            tensor that is not one of the model's parameters.
    """
    if optimizer.state:
        raise PeerEngineError("the optimizer has state already: call setup before its first step")
    for group in optimizer.param_groups:
        swapped = []
        for param in group["params"]:
            name = old_names.get(id(param))
            if name is None:
                raise PeerEngineError("the optimizer holds a tensor that is not a parameter of the model")
            swapped.append(new_params[name])
        group["params"] = swapped
