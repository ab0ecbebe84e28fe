"""Tensor parallelism of mixture-of-experts blocks (transformers' ``moe_tp_experts`` style).

A block holds a router (replicated) and the experts, whose weights are 3-D tensors
``[experts, out, in]``. Each tensor rank keeps its slice of every expert's intermediate dimension
(gate | up packed along dim 1: a rank's piece is ``[gate_r | up_r]``; down split along its input), so
every rank runs every expert on the tokens routed to it, and the ranks' outputs are summed: the
routing stays the same on every rank (the router sees every token), and there is no token dispatch.
The experts' own forward runs on ordinary tensors (their local pieces), as transformers' own
integration does; the sums are DTensor redistributions, so only ``engine/comm/`` talks to the
process group.

The block's input is gathered whole (from sequence shards with sequence parallelism) as an ordinary
tensor, and its output goes back to the between-block layout. The experts' output is summed with an
all-reduce (not a reduce-scatter as a row-parallel linear's) so that what the block adds beside them
(e.g. a replicated shared expert) stays whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from elixir_tune.engine.comm import DeviceMesh, DTensor, ParallelStyle, Partial, Replicate, Shard
from elixir_tune.engine.parallel.tp_layout import Layout, TensorParallelError
from elixir_tune.plan.tensor_layout import PACKED_PARTS

__all__ = ["ExpertsParallel", "MoeBlock"]


def _whole(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``tensor`` (a DTensor in the between-block layout, or a plain replicated tensor) as an ordinary
    tensor holding every token, whose gradient is taken to be whole on every rank."""
    if not isinstance(tensor, DTensor):
        return tensor
    return tensor.redistribute(mesh, (Replicate(),)).to_local(grad_placements=(Replicate(),))


def _sum_gradient(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``tensor`` unchanged forward; its gradient summed over the tensor group backward (each rank's
    slice of the experts contributes part of it)."""
    return DTensor.from_local(tensor, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


class MoeBlock(ParallelStyle):
    """A mixture-of-experts block (the parent of the experts): its input is gathered whole as an
    ordinary tensor, so the replicated router beside the experts runs on every token as plain
    PyTorch does, and its output (whole: the experts sum theirs) goes back to the between-block
    layout (cut to this rank's tokens with sequence parallelism, no traffic).
    """

    def __init__(self, between, local_out: bool):
        super().__init__()
        self.between = between
        self.local_out = local_out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        between, local_out = self.between, self.local_out

        def before(_module, args, kwargs):
            if args and torch.is_tensor(args[0]):
                return (_whole(args[0], device_mesh), *args[1:]), kwargs
            if torch.is_tensor(kwargs.get("hidden_states")):
                return args, {**kwargs, "hidden_states": _whole(kwargs["hidden_states"], device_mesh)}
            raise TensorParallelError(
                f"{type(_module).__name__}: its input is neither the first argument nor `hidden_states`; "
                "use tensor degree 1 for this model"
            )

        def back(output: torch.Tensor) -> torch.Tensor:
            if local_out:  # the residual stream is a plain replicated tensor already
                return output
            return DTensor.from_local(output, device_mesh, (Replicate(),), run_check=False).redistribute(
                device_mesh, (between,)
            )

        def after(_module, _args, _kwargs, output):
            if isinstance(output, tuple):
                return (back(output[0]), *output[1:])
            return back(output)

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, with_kwargs=True)
        return module


class ExpertsParallel(ParallelStyle):
    """The experts' 3-D tensors split over the tensor ranks (transformers' ``moe_tp_experts``): each
    rank keeps its slice of every expert's intermediate dimension (``packed``: gate | up packed along
    dim 1, a rank's piece ``[gate_r | up_r]``; ``rowwise``: down split along its input dimension),
    runs the module's own forward on its local pieces for the tokens routed to each expert, and the
    ranks' partial outputs are summed (an all-reduce forward). Backward, the gradients of the tokens
    and of the routing weights, partial per rank, are summed (``_sum_gradient``).

    Args:
        packed: the module's packed column-parallel parameters.
        rowwise: its row-parallel parameters.
    """

    def __init__(self, packed: tuple[str, ...], rowwise: tuple[str, ...]):
        super().__init__()
        self.packed = packed
        self.rowwise = rowwise

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Every rank holds the full weights already: it keeps its piece, no traffic.
        for name, param in list(module.named_parameters(recurse=False)):
            if name not in self.packed + self.rowwise:
                raise TensorParallelError(
                    f"{type(module).__name__}.{name}: the tensor table places the experts but not this tensor "
                    "(a replicated one would be summed over the ranks); profile the model again, or use tensor degree 1"
                )
            out_dim, in_dim = param.ndim - 2, param.ndim - 1
            packed = name in self.packed
            layout = Layout(
                (out_dim if packed else in_dim,), PACKED_PARTS if packed else 1, out_dim if packed else None
            )
            local = layout.local(param.detach(), (device_mesh.get_local_rank(),), (device_mesh.size(),)).contiguous()
            placement = Shard(out_dim if packed else in_dim)
            dtensor = DTensor.from_local(local, device_mesh, (placement,), run_check=False)
            module.register_parameter(name, nn.Parameter(dtensor, requires_grad=param.requires_grad))
        forward = module.forward

        def local_forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            originals = dict(module._parameters)
            # The module's own code runs on ordinary tensors: each parameter's local piece, whose
            # gradient flows back to the DTensor parameter.
            module._parameters.update({name: p.to_local() for name, p in originals.items() if isinstance(p, DTensor)})
            try:
                hidden_states = _sum_gradient(hidden_states, device_mesh)
                top_k_weights = _sum_gradient(top_k_weights, device_mesh)
                partial_out = forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
            finally:
                module._parameters.update(originals)
            summed = DTensor.from_local(partial_out, device_mesh, (Partial(),), run_check=False)
            return summed.redistribute(device_mesh, (Replicate(),)).to_local()

        module.forward = local_forward
        return module
