"""2D tensor parallelism after Optimus (Xu et al. 2021) on DTensor placements over a q x q grid.

Every weight matrix is split over the whole grid, its input dimension over the grid rows and its
output dimension over the grid columns, so no rank holds more than 1/q^2 of a layer's matrices;
norm weights and biases are split by the hidden dimension over the columns. Activations between
blocks are DTensors split both ways too: the batch over the grid rows, the hidden dimension over
the columns (``RESIDUAL``), so the residual stream, the norms and their saved inputs take 1/q^2 of a
rank's memory under 1D without sequence parallelism.

Inside the attention and the MLP, a rank works on its own samples (batch / q) and its own heads or
MLP columns (1/q of them): the block's input is gathered over the grid columns once (all q, k and v
read it), the entry linears (q, k, v, gate, up; GPT-2's c_attn, c_fc) give local outputs, and the
exit linear (o, down; GPT-2's c_proj) takes them back as a DTensor. The matrix products themselves
are DTensor's: its sharding propagation picks each op's redistribution (all-gathers, reduce-scatters,
all-reduces of partial sums), which is exact whatever it picks; docs/parallel.md compares the bytes
it moves with SUMMA's (measured: about 1.3x on a small GPT-2).

The plan is derived from the model's 1D tensor table (``plan/tensor_layout.py``, the same one 1D,
the search and ``validate`` read), style by style, for every family (``grid_plan``; docs/parallel.md,
"Tensor parallelism", 2d): column-parallel linears are entry linears and mark their parent as a
region, row-parallel ones exit linears, the vocabulary split and the residual-stream norms follow,
and per-head norms (or unplaced weights inside a region) stay whole with a gradient summed over the
grid. A mixture's experts have no grid form (``grid_problem``). GPT-2 adds its fused q | k | v.

The logits are gathered whole before the model's own loss; the micro-batch must divide by q.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from elixir_tune.engine.comm import DeviceMesh, DTensor, ParallelStyle, Replicate, Shard, distribute_module
from elixir_tune.engine.parallel.tp_adapters import (
    FamilyPlan,
    blocks_of,
    check_splittable,
    distribute_params,
    gpt2_local_heads,
    tied_parameters,
)
from elixir_tune.engine.parallel.tp_layout import TensorParallelError
from elixir_tune.models.tensor_table import model_tensor_table
from elixir_tune.plan.tensor_layout import TensorTable, grid_problem, in_region, local_shape, module_style

# The residual stream between blocks: batch over the grid rows, hidden over the grid columns.
RESIDUAL = (Shard(0), Shard(2))
# A block's input inside the attention or MLP: this rank's samples, every hidden feature.
ROW_SAMPLES = (Shard(0), Replicate())
REPLICATED = (Replicate(), Replicate())


def _to(tensor, mesh: DeviceMesh, placements: tuple, local: bool):
    """``tensor`` (a DTensor, or a local tensor in ``placements``) redistributed to ``placements``."""
    if not isinstance(tensor, DTensor):
        tensor = DTensor.from_local(tensor, mesh, placements, run_check=False)
    elif tuple(tensor.placements) != placements:
        tensor = tensor.redistribute(mesh, placements)
    return tensor.to_local() if local else tensor


def _linear_dims(module: nn.Module) -> dict[str, tuple[int | None, ...]]:
    """Optimus's split of a linear: input dimension over the grid rows, output over the columns."""
    if isinstance(module, nn.Linear):  # weight [out, in]
        return {"weight": (1, 0), "bias": (None, 0)}
    return {"weight": (0, 1), "bias": (None, 0)}  # transformers' Conv1D: weight [in, out]


@dataclass
class Linear2D(ParallelStyle):
    """A linear (``nn.Linear`` or transformers' ``Conv1D``) split over the grid.

    Attributes:
        input_layouts: the placements of a local (non-DTensor) input.
        output_layouts: the placements the output is redistributed to.
        use_local_output: return this rank's piece rather than the DTensor.
        fused_parts: fused output tensors (GPT-2's q | k | v), each split by heads.
    """

    input_layouts: tuple = ROW_SAMPLES
    output_layouts: tuple = RESIDUAL
    use_local_output: bool = False
    fused_parts: int = 1

    def _partition(self, name, module, mesh):
        dims = _linear_dims(module)
        out_dim = {"weight": dims["weight"][1], "bias": 0}
        distribute_params(module, mesh, dims, self.fused_parts, out_dim if self.fused_parts > 1 else None)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            return (_to(inputs[0], mesh, self.input_layouts, local=False), *inputs[1:])

        def output_fn(mod, output, mesh):
            return _to(output, mesh, self.output_layouts, self.use_local_output)

        return distribute_module(module, device_mesh, self._partition, input_fn, output_fn)


@dataclass
class Embedding2D(ParallelStyle):
    """An embedding split over the grid as the output head that may share its weight (vocabulary over
    the columns, hidden over the rows); its output goes to ``output_layouts``."""

    output_layouts: tuple = RESIDUAL
    split: bool = True  # False: only the hidden dimension is split (over the columns): position tables

    def _partition(self, name, module, mesh):
        distribute_params(module, mesh, {"weight": (1, 0) if self.split else (None, 1)})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            return (_to(inputs[0], mesh, REPLICATED, local=False), *inputs[1:])

        def output_fn(mod, output, mesh):
            return _to(output, mesh, self.output_layouts, local=False)

        return distribute_module(module, device_mesh, self._partition, input_fn, output_fn)


class Norm2D(ParallelStyle):
    """A norm on the residual stream: its weight and bias split by the hidden dimension over the
    grid columns (DTensor computes the statistics, all-reducing partial sums over the columns)."""

    def _partition(self, name, module, mesh):
        distribute_params(module, mesh, {name: (None, 0) for name, _ in module.named_parameters(recurse=False)})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition)


class LocalSamples(ParallelStyle):
    """The attention's or MLP's input (first positional argument, or ``hidden_states``) gathered
    over the grid columns and handed over as this rank's samples, an ordinary tensor; a per-sample
    ``attention_mask`` is cut to the same samples."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rows, row = device_mesh.size(0), device_mesh.get_local_rank(0)

        def hook(mod, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            batch = hidden.shape[0]
            local = _to(hidden, device_mesh, ROW_SAMPLES, local=True)
            if args:
                args = (local, *args[1:])
            else:
                kwargs["hidden_states"] = local
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.shape[0] == batch > 1:
                # A per-sample mask (eager attention builds one): this rank's samples only.
                kwargs["attention_mask"] = mask.chunk(rows, 0)[row]
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class Replicated2D(ParallelStyle):
    """A module inside an attention or MLP whose parameters stay whole on every rank (a per-head
    norm, OLMo2's q_norm over the gathered heads): its weights become replicated DTensors and its
    input, this rank's ordinary tensor, is taken as split by samples over the grid rows and, for a
    per-head norm, by heads (dimension -2) over the columns. Autograd then sums the weights'
    gradient over the grid (each rank saw its own samples and heads); the output is local again.

    Args:
        heads: the input is this rank's heads (a per-head norm), not every head.
    """

    def __init__(self, heads: bool):
        super().__init__()
        self.heads = heads

    def _partition(self, name, module, mesh):
        distribute_params(module, mesh, {name: (None, None) for name, _ in module.named_parameters(recurse=False)})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            local = inputs[0]
            columns = Shard(local.ndim - 2) if self.heads else Replicate()
            return (DTensor.from_local(local, mesh, (Shard(0), columns), run_check=False), *inputs[1:])

        def output_fn(mod, output, mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, self._partition, input_fn, output_fn)


def _entry(fused_parts: int = 1) -> Linear2D:
    """A column-parallel linear: this rank's samples in, its own heads or MLP columns out (local)."""
    return Linear2D(ROW_SAMPLES, RESIDUAL, use_local_output=True, fused_parts=fused_parts)


def _entry_gathered() -> Linear2D:
    """``colwise_gather``: the output gathered over the columns (every head of this rank's samples)."""
    return Linear2D(ROW_SAMPLES, ROW_SAMPLES, use_local_output=True)


def _exit(input_layouts: tuple = RESIDUAL) -> Linear2D:
    """A row-parallel linear back to the residual stream; ``ROW_SAMPLES`` input for ``rowwise_split``."""
    return Linear2D(input_layouts, RESIDUAL, use_local_output=False)


def _head() -> Linear2D:
    return Linear2D(RESIDUAL, REPLICATED, use_local_output=True)


def _styles(model: nn.Module, table: TensorTable) -> dict[str, ParallelStyle]:
    """Each module's 2D style from its 1D tensor-table style (the generic rule, docs/parallel.md)."""
    styles: dict[str, ParallelStyle] = {}
    regions = set()
    for path, module in model.named_modules():
        style = module_style(path, table) if path else None
        if style in ("colwise", "colwise_gather"):
            styles[path] = _entry() if style == "colwise" else _entry_gathered()
            regions.add(path.rpartition(".")[0])
        elif style in ("rowwise", "rowwise_split"):
            styles[path] = _exit() if style == "rowwise" else _exit(ROW_SAMPLES)
        elif style == "vocab":
            styles[path] = Embedding2D() if isinstance(module, nn.Embedding) else _head()
        elif style == "norm":
            styles[path] = Norm2D()
        elif style == "head_norm" or (
            style is None and path and in_region(path, table) and any(True for _ in module.parameters(recurse=False))
        ):
            styles[path] = Replicated2D(heads=style == "head_norm")
        elif style is not None:  # grid_problem refused the others
            raise TensorParallelError(f"{path}: style {style!r} has no 2d form; use tensor mode 1d")
    for region in regions:
        styles[region] = LocalSamples()
    return styles


def _gpt2_fixes(model: nn.Module, q: int, plan: FamilyPlan) -> None:
    """GPT-2 (our table, no transformers plan): the fused q | k | v of ``c_attn`` is split per head
    (each part by the columns), the attention told its local width, and the position table (not in
    the table) split by the hidden dimension over the columns, broadcast over the batch."""
    plan.styles["transformer.wpe"] = Embedding2D((Replicate(), Shard(2)), split=False)
    for i, block in enumerate(blocks_of(model, "transformer.h")):
        path = f"transformer.h.{i}"
        plan.styles[f"{path}.attn.c_attn"] = _entry(fused_parts=3)
        plan.fused[f"{path}.attn.c_attn.weight"] = (3, 1)
        plan.fused[f"{path}.attn.c_attn.bias"] = (3, 0)
        plan.local_attrs.extend(gpt2_local_heads(path, block, q))


def grid_plan(model: nn.Module, degree: int, table: TensorTable | None = None) -> FamilyPlan:
    """The 2D (q x q) tensor-parallel plan of ``model``, from its 1D tensor table.

    Args:
        model: a transformers causal LM.
        degree: the tensor degree q x q.
        table: the plan's record of the model's tensor table (empty or None: read from the model).

    Raises:
        TensorParallelError: not a square degree, no tensor table, a style with no 2D form (the
            experts of a mixture), or heads / key/value heads / vocabulary / a split dimension (hidden,
            intermediate) not divisible by q.
    """
    q = math.isqrt(degree)
    if q * q != degree or q < 2:
        raise TensorParallelError(f"2d tensor parallelism needs a square degree q x q >= 4, got {degree}")
    if not table:
        table, why = model_tensor_table(model)
        if why:
            raise TensorParallelError(f"tensor parallelism cannot run this model: {why}; set parallel.tensor.degree: 1")
    problem = grid_problem(table)
    if problem:
        raise TensorParallelError(f"{type(model).__name__}: {problem}")
    model_type = check_splittable(model, q)
    for name, param in model.named_parameters():
        try:
            local_shape(name, list(param.shape), model_type, degree, "2d", table)
        except ValueError as error:
            raise TensorParallelError(f"2d tensor parallelism on a {q} x {q} grid: {error}") from None
    plan = FamilyPlan(_styles(model, table), {}, [], tied_parameters(model))
    if model_type == "gpt2":
        _gpt2_fixes(model, q, plan)
    return plan
