"""The user's optimizer, rebuilt over this rank's fp32 shards.

``ShardedOptimizer`` is a torch.optim.Optimizer whose ``param_groups`` are the user's groups (so
LR schedulers work on it); at each step their hyperparameters are copied into inner optimizers of
the user's class, built over slices of the master shards: one tensor per (parameter, part of it in
this shard), with the parameter's group's hyperparameters. Elementwise optimizers (Adam, AdamW,
SGD) then do exactly what torch does per parameter. One inner optimizer per side (device shards,
host shards: the host one steps on the CPU), fused where torch has a fused implementation.

Adam's and SGD-momentum's state is preallocated as one flat buffer per chunk shard (so a shard
costs exactly 16, resp. 12, bytes per element) and handed to torch as views.

A default step does not wait for the device: the norm, the clip coefficient and the overflow flag
stay device tensors (the fused optimizers take the flag as ``found_inf``). The host side waits
only for its own gradients (the drain's per-chunk events). Every step all-reduces the global
gradient norm with a count of the step's non-finite losses (one collective): fp16 skips such a step
and lowers its loss scale; fp32 and bf16 skip it too and stop the run (``finite.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from elixir_tune.engine import grad_view
from elixir_tune.engine.chunks.host_memory import zeros_on_demand
from elixir_tune.engine.engine import Engine
from elixir_tune.engine.finite import FiniteGuard, nonfinite_count
from elixir_tune.engine.optimizer_state import (
    check_shard_identity,
    gather_whole_state,
    import_whole_state,
    is_torch_form,
    shard_identity,
    state_by_param,
    whole_form_refusal,
)
from elixir_tune.engine.scaler import DynamicLossScaler
from elixir_tune.engine.uneven import OPTIM

_IMPLEMENTATION_KEYS = ("fused", "foreach", "params")


@dataclass
class _ShardParam:
    slot_index: int
    tensor: torch.Tensor  # view of the master shard
    grad: torch.Tensor  # view of the shard gradient
    group: int  # user group index


@dataclass
class _GradStats:
    backward_passes: int
    found_inf: torch.Tensor  # 1.0 on the device when the norm or a loss of the step is not finite
    norm: torch.Tensor
    bad_losses: torch.Tensor  # non-finite micro-batch losses over all ranks


class ShardedOptimizer(torch.optim.Optimizer):
    """Keeps the user's optimizer class, groups and hyperparameters, over this rank's shards.

    Args:
        optimizer: the user's optimizer, built on ``model.parameters()``.
        engine: the engine holding the chunks.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, engine: Engine, find_unused_parameters: bool | None = None):
        self.engine = engine
        self.optimizer_class = type(optimizer)
        super().__init__([dict(group) for group in optimizer.param_groups], dict(optimizer.defaults))
        # The user's groups themselves, not copies: a scheduler built on the user's optimizer before
        # setup (or by a library) sets the lr that this optimizer steps with.
        self.param_groups = optimizer.param_groups
        self.user_optimizer = optimizer
        engine.optimizer = self  # model.zero_grad() clears through it
        device = engine.comm.device
        self.scaler = DynamicLossScaler(device) if engine.plan.training.dtype == "fp16" else None
        engine.scaler = self.scaler  # ElixirModel.forward_backward scales its losses by it
        # fp32 / bf16: a non-finite step stops the run (fp16's scaler skips it and recovers).
        self.finite_guard = FiniteGuard(device, engine.plan.training.dtype, engine.ops) if self.scaler is None else None
        engine.finite_guard = self.finite_guard  # the model's forward_backward, state_dict and saves check it
        engine.note_loss = self.note_loss  # forward_backward's micro-batch losses count in the step's check
        self.steps_done = 0  # optimizer steps, restored ones included: the step a NonFiniteError names
        self._loss_flags = torch.zeros((), dtype=torch.float32, device=device)  # fp16: non-finite losses
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        # None: learn it at the first step (one all-reduce); True: all-reduce the used flags every
        # step (parameters unused on every rank are skipped, as torch skips grad None); False:
        # every parameter gets a gradient in every step, no bookkeeping across ranks.
        self.find_unused_parameters = find_unused_parameters
        self._stats: _GradStats | None = None
        self._unscaled_at = -1
        group_of = {id(p): gi for gi, group in enumerate(self.param_groups) for p in group["params"]}
        self._entries: list[_ShardParam] = []
        per_side: dict[bool, list[_ShardParam]] = {False: [], True: []}
        for index, slot in enumerate(engine.slots):
            owned = slot.chunk.owned_range(slot)
            gi = group_of.get(id(slot.param))
            if owned is None or gi is None or slot.chunk.frozen:  # frozen: nothing to update
                continue
            begin, end = owned
            entry = _ShardParam(index, slot.chunk.master[begin:end], slot.chunk.grad[begin:end], gi)
            self._entries.append(entry)
            per_side[slot.chunk.offload].append(entry)
        self._inner: list[tuple[torch.optim.Optimizer, list[int]]] = []
        self._on_host: list[bool] = []
        for on_host, entries in per_side.items():  # the device side first: it runs while the host one does
            if entries:
                self._inner.append(self._build_inner(entries))
                self._on_host.append(on_host)
        self._preallocate_state()
        if optimizer.state:  # loaded (a resume) or stepped before setup: each rank takes its shard's part
            import_whole_state(self, {id(param): state for param, state in optimizer.state.items()})
            optimizer.state.clear()  # the whole-shape copies would hold a replica of the state
        # Tensor parallelism: a gradient piece that several tensor ranks hold alike (a replicated
        # parameter, or one split along one grid dimension only) counts once in the global norm.
        shares: dict[float, list[torch.Tensor]] = {}
        if engine.tensor_parallel is not None:
            for slot in engine.slots:
                owned = slot.chunk.owned_range(slot)
                share = engine.tensor_parallel.norm_share(slot.param)
                if owned is not None and share < 1.0 and not slot.chunk.frozen:
                    shares.setdefault(share, []).append(slot.chunk.grad[owned[0] : owned[1]])
        self._norm_shares = list(shares.items())
        self.trainable_params = len(engine.trainable_params)  # what torch.nn.utils.clip_grad_norm_ must be given
        grad_view.register(self, engine.trainable_params)
        self._stand_in_for(optimizer)

    def _stand_in_for(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's optimizer object does what this one does: a script (or a scheduler built before
        setup) that still holds it steps, clears and saves the sharded state, never its own."""
        step = self.step

        def user_step(*args, **kwargs):
            return step(*args, **kwargs)

        if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
            user_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # the scheduler's order check
        optimizer.step = user_step  # type: ignore[method-assign]
        optimizer.zero_grad = self.zero_grad  # type: ignore[method-assign]
        optimizer.state_dict = self.state_dict  # type: ignore[method-assign]
        optimizer.load_state_dict = self.load_state_dict  # type: ignore[method-assign]

    # --- construction --------------------------------------------------------------------------

    def _build_inner(self, entries: list[_ShardParam]) -> tuple[torch.optim.Optimizer, list[int]]:
        group_ids = sorted({entry.group for entry in entries})
        base_groups = []
        for gi in group_ids:
            group = {k: v for k, v in self.param_groups[gi].items() if k not in _IMPLEMENTATION_KEYS}
            group["params"] = [entry.tensor for entry in entries if entry.group == gi]
            base_groups.append(group)
        defaults = self.defaults
        attempts = []
        if "fused" in defaults:
            attempts.append({"fused": True, **({"foreach": None} if "foreach" in defaults else {})})
        attempts.append({"foreach": True} if "foreach" in defaults else {})
        error = None
        # The user's class: its constructor takes (params, **hyperparameters), not the base's (params, defaults).
        build: Callable[..., torch.optim.Optimizer] = self.optimizer_class
        for extra in attempts:
            try:
                inner = build([dict(group, **extra) for group in base_groups])
                return inner, group_ids
            except (RuntimeError, ValueError, TypeError) as exc:  # no fused kernel for this device/version
                error = exc
        raise RuntimeError(f"cannot rebuild {self.optimizer_class.__name__} over the shards: {error}")

    def _state_names(self) -> list[str]:
        """Per-element optimizer state that torch keeps for this class (preallocated flat)."""
        groups = self.param_groups
        if issubclass(self.optimizer_class, (torch.optim.Adam, torch.optim.AdamW)):
            return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if any(g.get("amsgrad") for g in groups) else [])
        if issubclass(self.optimizer_class, torch.optim.SGD):
            if any(g.get("momentum", 0) != 0 for g in groups) and all(g.get("dampening", 0) == 0 for g in groups):
                return ["momentum_buffer"]  # a zero buffer == torch's first-step clone of the gradient
        return []

    def _preallocate_state(self) -> None:
        names = self._state_names()
        for chunk in self.engine.chunks:
            if chunk.frozen:
                continue  # not trained: no optimizer state
            # Every chunk gets the full shard, padding included: 16 (Adam) or 12 (SGD) bytes/element.
            chunk.optimizer_flats = {
                # Host shards: zero until the first step writes them (resident from then on).
                name: zeros_on_demand(chunk.master.numel())
                if chunk.master.device.type == "cpu"
                else torch.zeros_like(chunk.master)
                for name in names
            }
            chunk.optimizer_state_bytes = sum(flat.nbytes for flat in chunk.optimizer_flats.values())
        by_tensor = {id(entry.tensor): entry for entry in self._entries}
        is_adam = issubclass(self.optimizer_class, (torch.optim.Adam, torch.optim.AdamW))
        for inner, _ in self._inner:
            for group in inner.param_groups:
                for tensor in group["params"]:
                    entry = by_tensor[id(tensor)]
                    chunk = self.engine.slots[entry.slot_index].chunk
                    begin = (tensor.data_ptr() - chunk.master.data_ptr()) // chunk.master.element_size()
                    state = inner.state[tensor]
                    for name in names:
                        if name == "max_exp_avg_sq" and not group.get("amsgrad"):
                            continue
                        if name == "momentum_buffer" and group.get("momentum", 0) == 0:
                            continue
                        state[name] = chunk.optimizer_flats[name][begin : begin + tensor.numel()]
                    if is_adam:
                        fused = group.get("fused") or group.get("capturable")
                        dtype = torch.float32 if fused or torch.get_default_dtype() != torch.float64 else torch.float64
                        state["step"] = (
                            torch.zeros((), dtype=dtype, device=tensor.device)
                            if fused
                            else torch.tensor(0.0, dtype=dtype)
                        )

    # --- the training-loop API -----------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the loss scale for fp16."""
        self.note_loss(loss)
        if self.scaler is not None:
            loss = loss * self.scaler.scale_tensor
        with self.engine.loss_context(), self.engine.scaled_backward():  # loss_parallel for a vocabulary-split loss
            loss.backward()

    def note_loss(self, loss: torch.Tensor) -> None:
        """Counts a micro-batch loss that is not finite (on the device) into this step's check."""
        if self.finite_guard is not None:
            self.finite_guard.note_loss(loss)
        elif torch.is_grad_enabled():
            self._loss_flags += nonfinite_count(loss).to(self._loss_flags.device)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """fp16 steps skipped on overflow (reading it synchronizes with the device)."""
        return int(self._skipped)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped.fill_(int(value))

    def _split_grads(self, for_norm: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Device and host shard gradients; ``for_norm`` leaves out the chunks another rank counts
        (a pipeline's shared chunk, held by two stages)."""
        chunks = [c for c in self.engine.chunks if not c.frozen and not (for_norm and c.id in self.engine.norm_skip)]
        return [c.grad for c in chunks if not c.offload], [c.grad for c in chunks if c.offload]

    def _grad_stats(self, norm_type: float = 2.0) -> _GradStats:
        """Unscales (fp16), then the global norm and whether the step is finite (its norm and the
        losses ``note_loss`` counted); one all-reduce per step (reused by ``step`` after a clip).

        Everything stays on the device: the overflow flag is a tensor that the fused optimizers
        and the loss scaler read there. Host gradients (offloaded chunks) are complete first.
        """
        engine = self.engine
        self._require_even("read the gradient norm")
        if engine.unscaled_backward:
            raise RuntimeError(
                "this fp16 plan's gradients were computed by loss.backward() without the loss scale (torch's GradScaler "
                "cannot scale for the shards); call optimizer.backward(loss) instead, which scales the loss"
            )
        engine.drain_grads()
        passes = engine.passes.backward_passes
        stats = self._stats
        if stats is not None and stats.backward_passes == passes:
            return stats
        device_grads, host_grads = self._split_grads()
        if self.scaler is not None and self._unscaled_at != passes:
            inverse = self.scaler.scale_tensor.reciprocal()
            _mul_(device_grads, inverse)
            _mul_(host_grads, inverse)
            self._unscaled_at = passes
        device = engine.comm.device
        inf = math.isinf(norm_type)
        parts = [_norm_part(grads, norm_type).to(device) for grads in self._split_grads(for_norm=True) if grads]
        local = torch.stack(parts) if parts else torch.zeros(1, device=device)
        local = (local.max() if inf else local.sum()).reshape(1)
        if not inf:
            for share, grads in self._norm_shares:
                local = local - (1.0 - share) * _norm_part(grads, norm_type).to(device)
        flags = self.finite_guard.loss_flags if self.finite_guard is not None else self._loss_flags
        local = torch.cat([local, flags.reshape(1).to(device)])  # and the step's non-finite losses
        # Over every rank: data shards, tensor pieces and pipeline stages hold different gradients.
        if inf:
            engine.mesh.world.all_reduce_max(local)
        else:
            engine.mesh.world.all_reduce_sum(local)
        norm = local[0] if inf else local[0] ** (1.0 / norm_type)
        found_inf = (~torch.isfinite(norm) | (local[1] > 0)).float()
        self._stats = _GradStats(passes, found_inf, norm, local[1])
        return self._stats

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients of all shards of all ranks together, as torch.nn.utils.clip_grad_norm_.

        The coefficient is clamped to 1 on the device (no host round trip); a non-finite norm
        leaves the gradients as they are (an fp16 overflow skips the step anyway).

        Args:
            max_norm: largest allowed global norm.
            norm_type: 2.0 or inf.

        Returns:
            The global norm before clipping (fp32 scalar tensor, same on every rank).
        """
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"clip_grad_norm supports norm_type 2 and inf, got {norm_type}")
        norm = self._grad_stats(norm_type=norm_type).norm
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
        device_grads, host_grads = self._split_grads()
        _mul_(device_grads, coef)
        _mul_(host_grads, coef)
        return norm

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm over every shard of every rank, without clipping (a collective).

        Args:
            norm_type: 2.0 or inf.

        Returns:
            The norm (fp32 scalar tensor, the same on every rank).
        """
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"grad_norm supports norm_type 2 and inf, got {norm_type}")
        return self._grad_stats(norm_type=norm_type).norm

    @torch.no_grad()
    def clip_grad_value(self, clip_value: float) -> None:
        """Clamps every gradient element into [-clip_value, clip_value], as torch.nn.utils.clip_grad_value_."""
        self._grad_stats()  # the gradients complete (and unscaled, fp16) first
        for grads in self._split_grads():
            for grad in grads:
                grad.clamp_(-clip_value, clip_value)

    def _mark_used(self) -> None:
        """Gives each shard entry its gradient, or None where no rank used the parameter."""
        engine = self.engine
        mode = self.find_unused_parameters
        if mode is False:
            if not bool(engine.grads.used.all()):  # a host tensor: no device round trip
                unused = [engine.slots[i].name for i in (~engine.grads.used).nonzero().flatten().tolist()]
                raise RuntimeError(
                    f"parameters got no gradient in this step ({', '.join(unused[:5])}) although every parameter "
                    "had one in the first step; pass find_unused_parameters=True to elixir_tune.setup for a model "
                    "that leaves some parameters unused in some steps"
                )
            for entry in self._entries:
                entry.tensor.grad = entry.grad
            return
        used = engine.grads.used.to(torch.float32).to(engine.comm.device)
        engine.comm.all_reduce_sum(used)  # used on any rank = has a gradient
        used = used.cpu() > 0
        if mode is None:
            self.find_unused_parameters = not bool(used.all())
        for entry in self._entries:
            # A parameter without a gradient anywhere is skipped, as torch skips grad None.
            entry.tensor.grad = entry.grad if bool(used[entry.slot_index]) else None

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step over this rank's shards (skipped on every rank on fp16 overflow).

        The device shards' optimizer is launched first; the host shards' waits only for the host
        gradients (the drain's per-chunk events), then runs on the CPU meanwhile.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._require_even("called optimizer.step()")
        self.user_optimizer._opt_called = True  # a scheduler built on it checks
        if self.finite_guard is not None:
            self.finite_guard.check()  # the previous step's (GPU: read one step late, without waiting)
        self.steps_done += 1
        self.engine.cache.wait_all()  # no gather may read a master while it is written
        stats = self._grad_stats()
        found_inf = stats.found_inf
        self._mark_used()
        for (inner, group_ids), on_host in zip(self._inner, self._on_host, strict=True):
            for inner_group, gi in zip(inner.param_groups, group_ids, strict=True):
                for key, value in self.param_groups[gi].items():
                    if key not in _IMPLEMENTATION_KEYS:
                        inner_group[key] = value
            if on_host:
                self.engine.drain_grads()
            if inner.param_groups[0].get("fused"):
                inner.found_inf = found_inf.to("cpu" if on_host else found_inf.device)
                inner.grad_scale = None
                inner.step()
            elif not bool(found_inf):  # no fused kernel: the decision has to come to the host
                inner.step()
            if on_host:
                for chunk in self.engine.chunks:
                    chunk.refresh_upload()
        if self.scaler is not None:
            self.scaler.update(found_inf)
            self._skipped += found_inf.to(torch.int64)
            self._loss_flags.zero_()
        self.engine.after_step()
        self._stats = None
        if self.finite_guard is not None:  # CPU: raises now; GPU: at the next step or save
            self.finite_guard.record(self.steps_done, stats.norm, stats.bad_losses)
        return loss

    def _require_even(self, what: str) -> None:
        if self.engine.agreement is not None:
            self.engine.agreement.require_even(what)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the shard gradients (buffers, never freed), after the reductions in flight; the
        parameters' ``p.grad`` placeholders become None, as torch sets gradients to None (or stay
        placeholders with ``set_to_none=False``)."""
        self.engine.zero_grad(set_to_none)
        self._stats = None
        self._unscaled_at = -1

    # --- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The optimizer state as DDP's optimizer gives it: torch's form, whole parameters.

        A collective, as ``model.state_dict()``: every rank calls it, or rank 0 alone where the
        others are about to run a forward. Rank 0 gets the dictionary (it loads into a plain torch
        optimizer too), the others an empty one. Under tensor or expert parallelism or a pipeline
        it is this rank's shard (``shard_state_dict``).
        """
        if whole_form_refusal(self.engine) is not None:
            return self.shard_state_dict()
        if self.engine.agreement is not None:  # rank 0 alone may ask, as nanoGPT does (uneven.py)
            self.engine.agreement.enter(OPTIM)
        whole = gather_whole_state(self)
        if whole and self.scaler is not None:
            whole["loss_scaler"] = self.scaler.state_dict()
        return whole

    def shard_state_dict(self) -> dict:
        """This rank's optimizer state (shard-local, marked with the rank and plan it belongs to) and
        the loss scaler: what the engine's checkpoints save on every rank."""
        return {
            "shard_of": shard_identity(self.engine),
            "inner": [inner.state_dict() for inner, _ in self._inner],
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores what ``state_dict`` saved on this rank (same plan and world size), or takes this
        rank's part of a whole-parameter state in torch's form (a DDP or plain run's save).

        Raises:
            OptimizerStateError: another rank's or plan's shard, or a torch-form state that does
                not fit this optimizer.
        """
        if is_torch_form(state_dict):
            import_whole_state(self, state_by_param(state_dict, self.param_groups))
            for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
                group.update({key: value for key, value in saved.items() if key != "params"})
            self.steps_done = max(self.steps_done, 1 if state_dict["state"] else 0)
            if self.scaler is not None and state_dict.get("loss_scaler"):
                self.scaler.load_state_dict(state_dict["loss_scaler"])
            return
        check_shard_identity(state_dict.get("shard_of"), self.engine)
        for (inner, _), state in zip(self._inner, state_dict["inner"], strict=True):
            flats = {
                id(p): {k: v for k, v in inner.state[p].items() if k != "step"}
                for g in inner.param_groups
                for p in g["params"]
            }
            inner.load_state_dict(state)
            for group in inner.param_groups:
                for param in group["params"]:
                    for name, view in flats[id(param)].items():
                        # Keep the state in the preallocated flat buffers.
                        loaded = inner.state[param].get(name)
                        if loaded is not None:
                            view.copy_(loaded)
                            inner.state[param][name] = view
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])
        # A checkpoint without group settings (or with fewer groups) keeps the current ones.
        for group, saved in zip(self.param_groups, state_dict.get("param_groups", []), strict=False):
            group.update(saved)


def _mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiplies in place by a scalar tensor that may live on another device (foreach kernels)."""
    if tensors:
        torch._foreach_mul_(tensors, factor.to(tensors[0].device))


def _norm_part(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The local part of a global norm: the max for inf, else the sum of p-th powers (foreach)."""
    norms = torch.stack(torch._foreach_norm(grads, norm_type))
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
