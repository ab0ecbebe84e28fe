"""Tensor parallelism (1D Megatron with sequence parallelism, 2D Optimus) under the chunk engine.

``apply_tensor_parallel`` turns an unmodified transformers model into its tensor-parallel form on
this rank's tensor group (``engine/parallel/tp_adapters.py`` builds the 1D styles from the model's tensor
table, ``plan/tensor_layout.py``; ``engine/parallel/tp_grid.py`` holds the 2D ones; docs/parallel.md describes both): the split
parameters become DTensors whose local tensors hold this rank's piece. The chunk engine then packs
those LOCAL pieces into its chunks and shards them over the data-parallel group, as FSDP2 composes
with tensor parallelism.

How a gathered chunk view becomes a DTensor's local tensor: a DTensor parameter is a wrapper whose
``_local_tensor`` is an ordinary tensor; the engine points that at its view of the chunk payload
(and at a NaN placeholder when the chunk is released), as FSDP2 does for its sharded parameters
(``reset_sharded_param``). The parameter object never changes, so autograd's saved references,
the post-accumulate-grad hooks and the optimizer's bookkeeping hold. ``local_data`` and
``set_local_data`` are the two accessors the chunk code uses; for a plain parameter they are
``param.data``.

Gradients: a split parameter's gradient is a DTensor with the same split: its local tensor is what
the chunk stages. A parameter replicated over the tensor group whose input was sequence-sharded
(the norms) gets a partial-sum gradient, which ``local_grad`` sums over the tensor group first.
The global gradient norm counts a piece held alike by several tensor ranks once
(``TensorSplit.norm_share``).

Importing this module loads no DTensor code (about half a second per process): the accessors ask
``comm.is_dtensor``, and the tensor-parallel APIs and the family tables (tp_adapters.py, tp_grid.py)
are imported when a model is split.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from elixir_tune.engine.comm import Comm, Mesh, grid_device_mesh, is_dtensor
from elixir_tune.engine.parallel.tp_layout import Layout, TensorParallelError, mesh_coords
from elixir_tune.plan import Plan

if TYPE_CHECKING:
    from elixir_tune.engine.comm import DeviceMesh

__all__ = [
    "TensorSplit",
    "TensorParallelError",
    "apply_tensor_parallel",
    "local_data",
    "local_grad",
    "plain",
    "set_local_data",
    "split_for_plan",
]


def local_data(param: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's values of ``param`` (its DTensor local tensor, or ``.data``)."""
    if is_dtensor(param):
        return param._local_tensor
    return param.data


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """An ordinary tensor: a replicated DTensor (a vocabulary-parallel loss) made whole, else ``tensor``."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def set_local_data(param: torch.Tensor, value: torch.Tensor) -> None:
    """Points ``param``'s values (a DTensor's local tensor, else ``.data``) at ``value``."""
    if is_dtensor(param):
        param._local_tensor = value
    else:
        param.data = value


def local_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a gradient, summed over the tensor group where it is a partial sum."""
    if not is_dtensor(grad):
        return grad
    from elixir_tune.engine.comm import Partial  # loaded already: a DTensor exists

    if is_dtensor(param) and tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    elif any(isinstance(p, Partial) for p in grad.placements):
        raise TensorParallelError(f"a gradient with placements {grad.placements} for a plain parameter")
    return grad.to_local()


class TensorSplit:
    """This rank's tensor-parallel layout of the model.

    Attributes:
        mesh: the tensor DeviceMesh (1-D; q x q for Optimus's 2D).
        comm: the tensor group (its rank order is the mesh's row-major order).
        degree: ranks in the tensor group.
        rank: this rank in it.
        layouts: id(parameter) -> its Layout (parameters not listed are replicated).
        mode: ``1d`` or ``2d``.
        sequence_parallel: 1d: norms and dropout run on sequence shards.
    """

    def __init__(
        self, mesh: DeviceMesh, comm: Comm, layouts: dict[int, Layout], mode: str = "1d", sequence_parallel: bool = True
    ):
        self.mesh = mesh
        self.comm = comm
        self.degree = comm.world_size
        self.rank = comm.rank
        self.sizes = tuple(mesh.shape)
        self.coords = mesh_coords(self.rank, self.sizes)
        self.layouts = layouts
        self.mode = mode
        self.sequence_parallel = sequence_parallel
        self.vocab_parallel_loss = False  # set by apply_tensor_parallel

    def loss_context(self):
        """``loss_parallel()`` when the logits stay split by vocabulary, else a no-op context."""
        from elixir_tune.engine.comm import loss_parallel

        return loss_parallel() if self.vocab_parallel_loss else contextlib.nullcontext()

    def layout(self, param: torch.Tensor) -> Layout:
        return self.layouts.get(id(param), Layout((None,) * len(self.sizes)))

    def norm_share(self, param: torch.Tensor) -> float:
        """The part of this parameter's squared gradient norm this rank counts: 1 over the number of
        tensor ranks holding the same piece (1 when the piece is its own)."""
        return 1.0 / self.layout(param).replicas(self.sizes)

    @torch.no_grad()
    def full_state(
        self, local_state: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The full state dict from this rank's pieces (a collective over the tensor group).

        Args:
            local_state: name -> this rank's value (pieces for split parameters), on the CPU.
            params: name -> the model's parameter (DTensor or plain), for the layouts and full shapes.
        """
        full = {}
        for name, value in local_state.items():
            param = params.get(name)
            layout = self.layout(param) if param is not None else Layout((None,))
            if param is None or not layout.sharded:
                full[name] = value
                continue
            gathered = torch.empty(self.degree * value.numel(), dtype=value.dtype, device=self.comm.device)
            self.comm.all_gather_into_tensor(gathered, value.to(self.comm.device).reshape(-1), async_op=False)
            pieces = [piece.view(value.shape).cpu() for piece in gathered.chunk(self.degree)]
            full[name] = layout.full(pieces, param.shape, self.sizes)
        return full

    def local_value(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full parameter value."""
        return self.layout(param).local(full, self.coords, self.sizes)


def apply_tensor_parallel(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    mesh: DeviceMesh,
    tensor: Comm,
    world: Comm,
    mode: str = "1d",
    sequence_parallel: bool = True,
    vocab_parallel_loss: bool = False,
    table: dict[str, str] | None = None,
    broadcast: bool = True,
) -> TensorSplit:
    """Splits ``model`` over this rank's tensor group, in place.

    Every rank first takes world rank 0's weights (as DDP does), then keeps its own piece of each
    split parameter (no other traffic). The optimizer's groups are pointed at the new parameters.
    Without ``broadcast`` the values are left as they are (a model on the meta device stays there:
    its pieces are meta DTensors that ``setup``'s weight source fills, each rank its own piece).

    Args:
        model: a transformers model with a tensor table (``plan/tensor_layout.py``), real weights.
        optimizer: the user's optimizer over ``model.parameters()``, or None.
        mesh: the DeviceMesh of the tensor group: 1-D, or the q x q grid for ``mode`` 2d.
        tensor: the tensor group.
        world: every rank (the weights are broadcast from its rank 0).
        mode: ``1d`` (Megatron) or ``2d`` (Optimus, engine/parallel/tp_grid.py).
        sequence_parallel: 1d: run norms and dropout on sequence shards.
        vocab_parallel_loss: 1d: keep the logits split by vocabulary and compute the model's loss
            under ``loss_parallel`` (ElixirModel's forward and the optimizer's ``backward`` enter it).
        table: the model's tensor table from the plan (empty or None: read from the model).
        broadcast: take world rank 0's weights first (False: the weights come later, from a source).

    Returns:
        The TensorSplit layout.

    Raises:
        TensorParallelError: unsupported family or sizes not divisible by the degree, or a meta
            model to broadcast.
    """
    from elixir_tune.engine.comm import DTensor, Shard, parallelize_module
    from elixir_tune.engine.parallel.tp_adapters import family_plan
    from elixir_tune.engine.parallel.tp_grid import grid_plan

    degree = tensor.world_size
    if broadcast and any(p.is_meta for p in model.parameters()):
        raise TensorParallelError(
            "a model on the meta device has no weights to broadcast: pass it to elixir_tune.setup, which reads "
            "each rank's pieces from weights=PATH or runs the model's initializer"
        )
    if mode == "2d":
        if vocab_parallel_loss:
            raise TensorParallelError("the vocabulary-parallel loss is for 1d tensor parallelism only")
        plan = grid_plan(model, degree, table)
    else:
        plan = family_plan(model, degree, sequence_parallel, vocab_parallel_loss, table)
    if broadcast:
        with torch.no_grad():
            for param in model.parameters():
                world.broadcast(param.data, src=0)
    old = {name: param for name, param in model.named_parameters(remove_duplicate=False)}
    parallelize_module(model, mesh, plan.styles, src_data_rank=None)
    for path, attr, value in plan.local_attrs:
        setattr(model.get_submodule(path), attr, value)
    for path, attr, owner in plan.tied:
        setattr(model.get_submodule(path), attr, model.get_parameter(owner))
    new = dict(model.named_parameters(remove_duplicate=False))
    if optimizer is not None:
        replacement = {id(old[name]): new[name] for name in old}
        for group in optimizer.param_groups:
            group["params"] = [replacement.get(id(p), p) for p in group["params"]]
    layouts: dict[int, Layout] = {}
    for name, param in new.items():
        if isinstance(param, DTensor) and any(p.is_shard() for p in param.placements):
            dims = tuple(p.dim if isinstance(p, Shard) else None for p in param.placements)
            fused = plan.fused.get(name)
            layouts[id(param)] = Layout(dims, fused[0], fused[1]) if fused else Layout(dims)
    split = TensorSplit(mesh, tensor, layouts, mode, sequence_parallel)
    split.vocab_parallel_loss = vocab_parallel_loss
    return split


def split_for_plan(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan,
    mesh: Mesh,
    fresh: bool = False,
    vocab_parallel_loss: bool = False,
) -> TensorSplit | None:
    """The plan's tensor parallelism applied to ``model`` (None when its tensor degree is 1).

    With ``fresh`` (the model is on the meta device, or its weights come from a file) the model is
    split as it is, on the meta device for meta tensors, and ``setup`` then builds its weight source
    over the split (``make_source(..., split=)``): each rank reads or initializes only its own pieces,
    no rank ever holds the whole model. Otherwise every rank takes world rank 0's weights first.

    Raises:
        TensorParallelError: the model cannot be split as the plan says.
    """
    tensor = plan.parallel.tensor
    if tensor.degree == 1:
        return None
    assert mesh.device_mesh is not None  # built whenever the tensor degree is above 1
    if tensor.mode == "2d":
        q = math.isqrt(tensor.degree)
        if plan.training.micro_batch_size % q:
            raise TensorParallelError(
                f"2d tensor parallelism splits each micro-batch over the {q} grid rows: training.micro_batch_size "
                f"{plan.training.micro_batch_size} must be a multiple of {q}"
            )
        device_mesh = grid_device_mesh(mesh, q)
    else:
        device_mesh = mesh.device_mesh["tensor"]
    return apply_tensor_parallel(
        model,
        optimizer,
        device_mesh,
        mesh.tensor,
        mesh.world,
        tensor.mode,
        tensor.sequence_parallel,
        vocab_parallel_loss,
        plan.model.tensor_layout,
        broadcast=not fresh,
    )
