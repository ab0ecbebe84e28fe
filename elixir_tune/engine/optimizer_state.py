"""Optimizer state across the engine's boundary: torch's whole-parameter form in, shard checks out.

A script resuming from a DDP run (or a plain one) holds ``optimizer.state_dict()`` in torch's form:
per parameter index, whole-shape ``exp_avg`` and the like. It may load that into its optimizer
before ``setup`` (nanoGPT does) or into the optimizer after it. Either way each rank takes the slice
of every tensor that its shard holds, so the run goes on exactly as the DDP run would have.

The engine's own ``state_dict`` is this rank's shard. It carries the rank, the world and the
chunk layout it belongs to, so that loading it on another rank or under another plan is refused
instead of training on the wrong moments.
"""

from __future__ import annotations

from typing import Any

import torch


class OptimizerStateError(ValueError):
    """An optimizer state this run cannot take; the message says what to do instead."""


def shard_identity(engine: Any) -> dict[str, Any]:
    """What a shard-local optimizer state belongs to: this rank, the world and the chunk layout."""
    return {
        "rank": engine.mesh.world.rank,
        "world_size": engine.mesh.world.world_size,
        "fingerprint": engine.plan.model.fingerprint,
        "chunk_size": engine.plan.memory.chunk_size,
    }


def check_shard_identity(saved: dict[str, Any] | None, engine: Any) -> None:
    """Refuses a shard-local state saved by another rank, world or plan (older saves carry none).

    Raises:
        OptimizerStateError: the state is another rank's shard or another layout's.
    """
    if saved is None:
        return
    here = shard_identity(engine)
    differs = [f"{key} {saved.get(key)!r} (here {value!r})" for key, value in here.items() if saved.get(key) != value]
    if differs:
        raise OptimizerStateError(
            "this optimizer state is one rank's shard of another place: " + ", ".join(differs) + ". Under "
            "elixir-run, optimizer.state_dict() holds this rank's shard only; save it on every rank (one "
            "file per rank) and load each rank's own file under the same plan, or use the recipes' "
            "--save/--resume (elixir_tune.save_checkpoint), which does both"
        )


def is_torch_form(state_dict: dict[str, Any]) -> bool:
    """Whether ``state_dict`` is torch's whole-parameter form (``state`` and groups with ``params``)."""
    groups = state_dict.get("param_groups")
    return "state" in state_dict and isinstance(groups, list) and all("params" in group for group in groups)


def state_by_param(state_dict: dict[str, Any], param_groups: list[dict]) -> dict[int, dict[str, torch.Tensor]]:
    """Maps ``id(param)`` of the user's parameters to its saved whole-shape state.

    Raises:
        OptimizerStateError: the saved groups do not have the user's groups' sizes.
    """
    saved_groups = state_dict["param_groups"]
    saved_sizes = [len(group["params"]) for group in saved_groups]
    sizes = [len(group["params"]) for group in param_groups]
    if saved_sizes != sizes:
        raise OptimizerStateError(
            f"the saved optimizer state has parameter groups of {saved_sizes} parameters, this optimizer "
            f"{sizes}: build the optimizer with the same groups as the run that saved it"
        )
    out: dict[int, dict[str, torch.Tensor]] = {}
    for group, saved in zip(param_groups, saved_groups, strict=True):
        for param, index in zip(group["params"], saved["params"], strict=True):
            if index in state_dict["state"]:
                out[id(param)] = state_dict["state"][index]
    return out


def import_whole_state(optimizer: Any, whole: dict[int, dict[str, torch.Tensor]]) -> int:
    """Copies each parameter's slice of whole-shape saved state into this rank's shard state.

    Args:
        optimizer: the ``ShardedOptimizer`` (its inner optimizers' state already preallocated).
        whole: ``id(user parameter)`` -> that parameter's saved state (torch's form).

    Returns:
        The parameters whose state was taken.

    Raises:
        OptimizerStateError: the layout splits parameters across ranks in ways a whole-parameter
            state cannot follow (tensor or expert parallelism), a saved tensor has another shape,
            or the optimizer keeps state the engine does not preallocate.
    """
    engine = optimizer.engine
    if not whole:
        return 0
    if engine.tensor_parallel is not None or engine.experts is not None:
        raise OptimizerStateError(
            "a whole-parameter optimizer state cannot be loaded under tensor or expert parallelism (the "
            "parameters themselves are split); start the optimizer fresh, or resume from the recipes' "
            "--save/--resume checkpoint"
        )
    by_tensor = {id(entry.tensor): entry for entry in optimizer._entries}
    taken = set()
    for inner, _ in optimizer._inner:
        for group in inner.param_groups:
            for tensor in group["params"]:
                slot = engine.slots[by_tensor[id(tensor)].slot_index]
                saved = whole.get(id(slot.param))
                if saved is None:
                    continue
                _copy_slice(inner.state[tensor], saved, slot, tensor.numel())
                taken.add(id(slot.param))
    return len(taken)


def _copy_slice(target: dict[str, torch.Tensor], saved: dict[str, Any], slot: Any, numel: int) -> None:
    begin_in_shard, _ = slot.chunk.owned_range(slot)
    begin = slot.chunk.shard_begin + begin_in_shard - slot.offset  # where this shard's part starts in the param
    for name, value in saved.items():
        held = target.get(name)
        if held is None:
            raise OptimizerStateError(
                f"the saved optimizer state has {name!r} for {slot.name}, which the engine does not keep for "
                f"this optimizer (it preallocates Adam's, AdamW's and SGD momentum's state): load the state with "
                "one of those, or start the optimizer fresh"
            )
        if name == "step":
            held.copy_(torch.as_tensor(value, dtype=held.dtype))
            continue
        if value.shape != slot.param.shape:
            raise OptimizerStateError(
                f"the saved {name!r} of {slot.name} has shape {tuple(value.shape)}, the parameter "
                f"{tuple(slot.param.shape)}: the state belongs to another model"
            )
        held.copy_(value.detach().reshape(-1)[begin : begin + numel].to(held.dtype))


def whole_form_refusal(engine: Any) -> str | None:
    """Why this plan's optimizer state cannot be gathered into torch's form; None when it can.

    Tensor and expert parallelism split parameters themselves, and a pipeline rank holds only its
    stage: there ``optimizer.state_dict()`` stays this rank's shard.
    """
    if engine.tensor_parallel is not None:
        return "tensor parallelism"
    if engine.experts is not None:
        return "expert parallelism"
    if engine.pipeline is not None:
        return "a pipeline"
    return None


@torch.no_grad()
def gather_whole_state(optimizer: Any) -> dict[str, Any]:
    """The optimizer state in torch's form, whole parameters, on rank 0 (a collective).

    Every trained chunk's flat state (``exp_avg``, ...) is gathered to rank 0 one chunk and one
    name at a time, so rank 0 holds one whole chunk of it beside the dictionary it builds.

    Args:
        optimizer: the ``ShardedOptimizer``.

    Returns:
        On rank 0, ``{"state": {index: {...}}, "param_groups": [...]}`` indexed as the user's
        optimizer would index it (empty ``state`` before the first step, as torch's); ``{}`` on the
        other ranks.
    """
    engine = optimizer.engine
    on_rank0 = engine.comm.rank == 0
    index_of = {id(param): i for i, param in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    state: dict[int, dict[str, torch.Tensor]] = {}
    step = _step_value(optimizer)
    for chunk in engine.chunks:
        if chunk.frozen or optimizer.steps_done == 0:
            continue
        for name, flat in chunk.optimizer_flats.items():
            whole = torch.empty(chunk.chunk_size, dtype=flat.dtype, device=engine.device) if on_rank0 else None
            engine.comm.gather_to(whole, flat.to(engine.device), dst=0)
            if whole is None:
                continue
            whole = whole.cpu()
            for slot in chunk.slots:
                index = index_of.get(id(slot.param))
                if index is None:
                    continue
                entry = state.setdefault(index, {} if step is None else {"step": step.clone()})
                entry[name] = whole[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
    if not on_rank0:
        return {}
    groups = []
    for group in optimizer.param_groups:
        saved = {key: value for key, value in group.items() if key != "params"}
        groups.append(dict(saved, params=[index_of[id(param)] for param in group["params"]]))
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def _step_value(optimizer: Any) -> torch.Tensor | None:
    """Adam's per-parameter ``step`` (the same for every parameter here), as torch keeps it; None
    for an optimizer that keeps no step (SGD)."""
    for inner, _ in optimizer._inner:
        for group in inner.param_groups:
            for tensor in group["params"]:
                step = inner.state[tensor].get("step")
                if step is not None:
                    return step.detach().cpu().clone()
    return None
