"""Expert parallelism of mixture-of-experts blocks (transformers' ``base_model_ep_plan``).

A group of E data ranks (the expert group, ``comm.expert_groups``) holds every expert of each block
once: rank r keeps experts ``[r * X / E, (r + 1) * X / E)`` of the X in its 3-D expert tensors
(``gate_up_proj``, ``down_proj``: ``[experts, out, in]``). Each rank feeds its own micro-batch, as
in plain data parallelism; the router is an ordinary replicated parameter and runs on this rank's
tokens. The experts module's forward (``hidden_states [N, H]``, ``top_k_index [N, k]``,
``top_k_weights [N, k]``) becomes a dispatch:

    1. the N x k (token, expert) pairs are sorted by expert (stable: a token's experts in ascending
       order, the order plain PyTorch adds them in), so each destination rank's rows are consecutive;
    2. the per-expert counts go to every rank of the group (an all-to-all of E x X / E integers),
       then the tokens' rows (an all-to-all with those split sizes: nothing is dropped, any
       imbalance is carried);
    3. the module's own forward runs on the rows received, each with its local expert index and
       weight 1, so the family's expert code (its activation, its gate | up packing) is reused;
    4. the outputs go back by the reverse all-to-all, are multiplied by their routing weights and
       added into each token's row in the sorted order.

Backward is the same exchanges reversed (``comm.all_to_all_rows``). The gradient of a local expert
thus already holds the contributions of every token of the expert group; the chunk engine reduces it
over the expert-data group (the data ranks holding the same experts) and divides by the whole data
size, so it is the mean over the global batch as for any other parameter (engine.py).

Where the weights come from: a model built with real weights has each whole expert tensor broadcast
from data rank 0 and keeps its slice. A model on the meta device, or one started from ``weights=``,
gets the slice's shape only (meta stays meta); the weight source (engine/io/materialize.py) then
gives each rank its experts' rows: a safetensors file is read at the slice's element range (the
experts are the first dimension, so a rank's slice is one contiguous run of the file's tensor) and
the initializer's full value is cut. No rank then holds another rank's experts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from elixir_tune.engine.comm import Comm, Mesh, all_to_all_rows, exchange_counts, expert_groups
from elixir_tune.models.hf_plans import config_plan

__all__ = ["ExpertParallelError", "ExpertSplit", "expert_modules", "split_experts"]

DISPATCH_STYLE = "ep_dispatch_experts"


class ExpertParallelError(ValueError):
    """The model cannot be split as the plan's expert degree asks."""


@dataclass
class ExpertSplit:
    """A model's experts split over the expert groups.

    Attributes:
        degree: expert degree E.
        group: this rank's expert group (E ranks holding different experts; tokens go between them).
        replicas: this rank's expert-data group (the data ranks holding the same experts).
        data_size: the data-parallel size: expert gradients are divided by it (the global mean).
        modules: expert module name -> (first local expert, local experts, all experts).
        param_slices: id of each split parameter -> (first local expert, local experts): its chunks
            reduce over ``replicas``, full state dicts gather it over ``group``.
    """

    degree: int
    group: Comm
    replicas: Comm
    data_size: int
    modules: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    param_slices: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def param_ids(self) -> set[int]:
        return set(self.param_slices)

    @torch.no_grad()
    def gather(self, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """The whole expert tensor from every rank's ``local`` slice (a collective over the expert group)."""
        group = self.group
        gathered = torch.empty(self.degree * local.numel(), dtype=local.dtype, device=group.device)
        group.all_gather_into_tensor(gathered, local.to(group.device).reshape(-1), async_op=False)
        return gathered.view(self.degree * local.shape[0], *local.shape[1:]).cpu()

    def local_value(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a whole expert tensor ``full`` (``full`` itself for other parameters)."""
        where = self.param_slices.get(id(param))
        if where is None or full.shape == param.shape:
            return full
        first, local = where
        return full[first : first + local]

    def first_element(self, param: torch.Tensor) -> int:
        """Where this rank's slice of ``param`` starts in the whole tensor, flattened (0 for a
        parameter that is not split): the slice is rows ``[first, first + local)`` of dimension 0."""
        where = self.param_slices.get(id(param))
        if where is None:
            return 0
        return where[0] * math.prod(param.shape[1:])


def _pattern(key: str) -> re.Pattern[str]:
    """An ep plan key (``layers.*.mlp.experts``, ``*`` = one path component) as a regex of module names."""
    return re.compile("(?:.*\\.)?" + "\\.".join("[^.]+" if part == "*" else re.escape(part) for part in key.split(".")))


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules the model's ``config.base_model_ep_plan`` dispatches tokens to (``ep_dispatch_experts``).

    Raises:
        ExpertParallelError: the model's config ships no expert plan, or the plan names no module.
    """
    ep_plan = config_plan(getattr(model, "config", None), "base_model_ep_plan")
    patterns = [_pattern(key) for key, style in ep_plan.items() if style == DISPATCH_STYLE]
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if not patterns:
        raise ExpertParallelError(
            f"model type {model_type!r} ships no expert plan (config.base_model_ep_plan with "
            f"{DISPATCH_STYLE!r}); use parallel.expert.degree 1 for this model"
        )
    found = [(name, module) for name, module in model.named_modules() if any(p.fullmatch(name) for p in patterns)]
    if not found:
        raise ExpertParallelError(
            f"model type {model_type!r}: its expert plan names modules {sorted(ep_plan)} but the model has none "
            "of them; use parallel.expert.degree 1"
        )
    return found


def split_experts(model: nn.Module, mesh: Mesh, degree: int, from_source: bool = False) -> ExpertSplit:
    """Keeps this rank's experts of every block and turns each experts module's forward into the
    token dispatch (a collective: every rank of the world calls it).

    Without a weight source the whole expert tensors are first broadcast from data rank 0 (rank 0's
    weights win, as for every other parameter), then each rank keeps its slice in place
    (``param.data``: the optimizer's references stay valid). With one (``from_source``: the model is
    on the meta device or its weights come from ``weights=``) each parameter only takes the slice's
    shape, and the source gives this rank's rows later (``ExpertSplit.local_value``, ``first_element``).

    Args:
        model: the user's model.
        mesh: the run's mesh; the expert groups are cut from its data groups.
        degree: expert degree E (divides the data size and every block's expert count).
        from_source: the engine's weight source gives the values; nothing is broadcast.

    Returns:
        The split (its groups and the split parameters, for the engine's chunks and weight source).

    Raises:
        ExpertParallelError: the model has no expert plan, its experts do not divide by E, or an
            expert tensor is on the meta device with no weight source.
    """
    modules = expert_modules(model)
    group, replicas = expert_groups(mesh, degree)
    split = ExpertSplit(degree, group, replicas, mesh.data.world_size)
    for name, module in modules:
        params = list(module.named_parameters(recurse=False))
        total = int(getattr(module, "num_experts", params[0][1].shape[0] if params else 0))
        if total % degree:
            raise ExpertParallelError(
                f"{name}: {total} experts do not divide by expert degree {degree}; pick a degree that divides them"
            )
        local = total // degree
        first = group.rank * local
        for pname, param in params:
            if param.ndim < 1 or param.shape[0] != total:
                raise ExpertParallelError(
                    f"{name}.{pname}: shape {list(param.shape)} is not [experts={total}, ...]; this experts module "
                    "cannot be split, use parallel.expert.degree 1"
                )
            if from_source:  # the source gives the values: the slice's shape is all that is needed here
                if param.is_meta:
                    param.data = torch.empty((local, *param.shape[1:]), dtype=param.dtype, device="meta")
                else:
                    param.data = param.data[first : first + local].clone()
            elif param.is_meta:
                raise ExpertParallelError(
                    f"{name}.{pname} is on the meta device and no weight source was given; pass weights= to setup "
                    "or build the model with its weights"
                )
            else:
                whole = param.detach().to(mesh.data.device).contiguous()
                mesh.data.broadcast(whole, src=0)
                param.data = whole[first : first + local].clone().to(param.device)
            split.param_slices[id(param)] = (first, local)
        module.num_experts = local  # type: ignore[assignment]  # the family's forward loops over its local experts
        _dispatch(module, group, local, total)
        split.modules[name] = (first, local, total)
    return split


def _dispatch(module: nn.Module, group: Comm, local: int, total: int) -> None:
    """Replaces ``module.forward`` by the token dispatch over ``group`` (module docstring)."""
    forward = module.forward
    ranks = group.world_size

    def dispatched(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        top_k = top_k_index.shape[-1]
        flat_expert = top_k_index.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        token_of = order // top_k
        # How many rows this rank sends to each expert; what every rank sends to this rank's experts.
        send_per_expert = torch.bincount(flat_expert, minlength=total).to(torch.int64)
        receive_per_expert = exchange_counts(group, send_per_expert.to(group.device)).cpu()
        send_counts = send_per_expert.view(ranks, local).sum(1).tolist()
        receive_counts = receive_per_expert.view(ranks, local).sum(1).tolist()
        received = all_to_all_rows(group, hidden_states[token_of], send_counts, receive_counts)
        # Row i came from rank s for local expert l: the counts are in (source rank, local expert) order.
        local_index = torch.repeat_interleave(torch.arange(local).repeat(ranks), receive_per_expert).to(received.device)
        ones = torch.ones((received.shape[0], 1), dtype=top_k_weights.dtype, device=received.device)
        expert_out = forward(received, local_index[:, None], ones)
        returned = all_to_all_rows(group, expert_out, receive_counts, send_counts)
        weights = top_k_weights.reshape(-1)[order]
        combined = torch.zeros_like(hidden_states)
        return combined.index_add(0, token_of, (returned * weights[:, None]).to(combined.dtype))

    module.forward = dispatched
