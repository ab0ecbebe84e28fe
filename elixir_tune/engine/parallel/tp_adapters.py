"""Tensor-parallel plans for unmodified transformers models (1-D, Megatron style).

Every family runs from its tensor table (``plan/tensor_layout.py``: module pattern -> colwise,
rowwise, vocab, norm, ...; translated from the model's own ``config.base_model_tp_plan`` and
carried by the plan): ``table_plan`` turns it into ``parallelize_module``'s styles
(``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``) plus ``RegionInput``, which gathers
the input of each attention and MLP once. GPT-2 keeps a hand-written plan (``_gpt2_plan``) for its
``Conv1D`` (weights stored ``[in, out]``, which torch's styles do not take) and the per-head split
of its fused ``c_attn`` (q | k | v in one matrix): each rank keeps its own heads of q, k and v, so
its local piece is ``[q_r | k_r | v_r]``, not a contiguous third of the columns.

With sequence parallelism (the default) the residual stream between blocks is a DTensor sharded
on the sequence dimension: norms and dropout run on ``S / T`` tokens, each block all-gathers its
input before the attention and the MLP and reduce-scatters their outputs. Without it, the
residual stream is an ordinary replicated tensor and the row-parallel outputs are all-reduced.

Attention modules reshape with ``-1`` heads (transformers 5.x), so local head counts need no
patching, except GPT-2's ``split_size`` (the width of q, k and v in the fused output), set here to
the local width. The vocabulary (embedding rows, output-head rows) is split over the tensor ranks;
the logits are gathered whole before the model's own loss, so the loss code is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from elixir_tune.engine.comm import (
    ColwiseParallel,
    DeviceMesh,
    DTensor,
    ParallelStyle,
    Partial,
    PrepareModuleInput,
    PrepareModuleOutput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    distribute_module,
)
from elixir_tune.engine.parallel.tp_experts import ExpertsParallel, MoeBlock
from elixir_tune.engine.parallel.tp_layout import Layout, TensorParallelError
from elixir_tune.models.tensor_table import model_tensor_table
from elixir_tune.plan.tensor_layout import (
    MODULE_STYLES,
    PACKED_PARTS,
    TensorTable,
    local_shape,
    module_style,
    moe_blocks,
    unknown_styles,
)

# --- GPT-2's Conv1D -----------------------------------------------------------------------------------


def distribute_params(
    module: nn.Module,
    mesh: DeviceMesh,
    dims: dict[str, tuple[int | None, ...]],
    parts: int = 1,
    fused_dims: dict[str, int] | None = None,
) -> None:
    """Replaces ``module``'s parameters by DTensors holding this rank's piece (no communication:
    every rank holds the full weights already).

    Args:
        dims: parameter name -> the parameter dimension each mesh dimension splits (None: replicated).
        parts: fused tensors (GPT-2's q | k | v), each split by heads, along ``fused_dims[name]``.
    """
    sizes = tuple(mesh.shape)
    coords = tuple(mesh.get_local_rank(m) for m in range(mesh.ndim))
    for name, param in list(module.named_parameters(recurse=False)):
        fused_dim = (fused_dims or {}).get(name)
        layout = Layout(dims[name], parts if fused_dim is not None else 1, fused_dim)
        local = layout.local(param.detach(), coords, sizes).contiguous()
        placements = [Replicate() if dim is None else Shard(dim) for dim in layout.dims]
        dtensor = DTensor.from_local(local, mesh, placements, run_check=False)
        module.register_parameter(name, nn.Parameter(dtensor, requires_grad=param.requires_grad))


class Conv1DColwise(ParallelStyle):
    """Column-parallel ``Conv1D`` (weight ``[in, out]``: split dim 1, bias dim 0); local output.

    Args:
        input_layouts: the layout of the input when it is not already a DTensor.
        fused_parts: the output columns hold this many fused tensors (3 for GPT-2's q | k | v),
            each split by heads.
    """

    def __init__(self, *, input_layouts=None, fused_parts: int = 1):
        super().__init__()
        self.input_layouts = (input_layouts or Replicate(),)
        self.fused_parts = fused_parts

    def _partition(self, name, module, mesh):
        distribute_params(module, mesh, {"weight": (1,), "bias": (0,)}, self.fused_parts, {"weight": 1, "bias": 0})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            partial(ColwiseParallel._prepare_input_fn, self.input_layouts, (Replicate(),)),
            partial(ColwiseParallel._prepare_output_fn, (Shard(-1),), True),
        )


class Conv1DRowwise(ParallelStyle):
    """Row-parallel ``Conv1D`` (weight ``[in, out]``: split dim 0, bias replicated).

    Args:
        output_layouts: ``Shard(1)`` (sequence parallel: reduce-scatter) or ``Replicate()`` (all-reduce).
        use_local_output: return a plain tensor (the replicated case) rather than the DTensor.
    """

    def __init__(self, *, output_layouts=None, use_local_output: bool = True):
        super().__init__()
        self.output_layouts = (output_layouts or Replicate(),)
        self.use_local_output = use_local_output

    def _partition(self, name, module, mesh):
        distribute_params(module, mesh, {"weight": (0,), "bias": (None,)})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            partial(RowwiseParallel._prepare_input_fn, (Shard(-1),), (Shard(-1),)),
            partial(RowwiseParallel._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


# --- the family tables --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FamilyPlan:
    """What ``parallelize_module`` gets for one model, and what to fix up around it.

    Attributes:
        styles: module path -> style.
        fused: parameter name -> (fused parts, their dimension) (GPT-2's c_attn: 3 along the output).
        local_attrs: (module path, attribute, local value) set after partitioning.
        tied: (alias module path, attribute, owner parameter name) to re-tie after partitioning.
    """

    styles: dict[str, ParallelStyle]
    fused: dict[str, tuple[int, int]]
    local_attrs: list[tuple[str, str, int]]
    tied: list[tuple[str, str, str]]


def blocks_of(model: nn.Module, path: str) -> nn.ModuleList:
    """The ModuleList of repeated blocks at ``path``."""
    blocks = model.get_submodule(path)
    assert isinstance(blocks, nn.ModuleList), f"{path} is a {type(blocks).__name__}, not a ModuleList"
    return blocks


def gpt2_local_heads(path: str, block: nn.Module, parts: int) -> list[tuple[str, str, int]]:
    """GPT-2's attention splits its fused output at ``split_size`` (the width of q, k, v): with the
    heads split ``parts`` ways a rank sees the local width (and head count)."""
    attn = block.get_submodule("attn")
    return [(f"{path}.attn", name, int(getattr(attn, name)) // parts) for name in ("split_size", "num_heads")]


def _sequence(sp: bool):
    """(between-block layout, local output?) of row-parallel outputs."""
    return (Shard(1), False) if sp else (Replicate(), True)


class RegionInput(ParallelStyle):
    """The input of an attention or MLP (the parent of column-parallel linears) as a replicated
    DTensor: gathered from sequence shards with sequence parallelism. The column-parallel layers'
    input gradients (partial sums) then add up before ONE reduction, instead of one per q, k, v
    (gate, up) as with a plain input. The input is the first positional argument, else the
    ``hidden_states`` keyword (families call their attention either way).
    """

    def __init__(self, between):
        super().__init__()
        self.between = between

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        between = self.between

        def to_replicated(tensor):
            if not isinstance(tensor, DTensor):
                tensor = DTensor.from_local(tensor, device_mesh, (between,), run_check=False)
            return tensor.redistribute(device_mesh, (Replicate(),))

        def hook(_module, args, kwargs):
            if args and torch.is_tensor(args[0]):
                return (to_replicated(args[0]), *args[1:]), kwargs
            if torch.is_tensor(kwargs.get("hidden_states")):
                return args, {**kwargs, "hidden_states": to_replicated(kwargs["hidden_states"])}
            raise TensorParallelError(
                f"{type(_module).__name__}: its tensor plan splits linears inside it, but its input is neither "
                "the first argument nor `hidden_states`; use tensor degree 1 for this model"
            )

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class ReplicatedLinear(ParallelStyle):
    """A linear replicated over the tensor group as DTensors (a LoRA layer's adapter beside a split
    base, ``elixir_tune/models/lora_layout.py``): it takes a DTensor input (a plain one is replicated) and
    gives a DTensor, so a partial-sum input gives partial sums and its gradient, a partial sum, is
    summed over the tensor group by the engine (``local_grad``)."""

    def _partition(self, name, module, mesh):
        distribute_params(module, mesh, {n: (None,) * mesh.ndim for n, _ in module.named_parameters(recurse=False)})

    @staticmethod
    def _prepare_input(module, inputs, mesh):
        first = inputs[0]
        if not isinstance(first, DTensor):
            first = DTensor.from_local(first, mesh, (Replicate(),) * mesh.ndim, run_check=False)
        return (first, *inputs[1:])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._prepare_input)


def _region_of(path: str, table: TensorTable) -> str:
    """The module whose input a column-parallel linear's input is gathered at: its parent, or, inside a
    LoRA layer (its base or its ``lora_B``), the LoRA layer's parent."""
    parts = path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if module_style(".".join(parts[:end]), table) == "lora_colwise":
            return ".".join(parts[: end - 1])
    return path.rpartition(".")[0]


def table_plan(model: nn.Module, table: TensorTable, sp: bool, vocab_parallel_loss: bool) -> FamilyPlan:
    """The 1-D plan of a model with ``nn.Linear`` layers from its tensor table (every family with a
    transformers tensor plan; plan/tensor_layout.py describes the styles)."""
    between, local_out = _sequence(sp)
    styles: dict[str, ParallelStyle] = {}
    fused: dict[str, tuple[int, int]] = {}
    regions = set()
    for path, module in model.named_modules():
        style = module_style(path, table) if path else None
        if style is None:
            continue
        if style in ("colwise", "colwise_gather"):
            gathered = style == "colwise_gather"
            styles[path] = ColwiseParallel(output_layouts=Replicate()) if gathered else ColwiseParallel()
            regions.add(_region_of(path, table))
        elif style in ("rowwise", "rowwise_split"):
            whole = {"input_layouts": Replicate()} if style == "rowwise_split" else {}
            styles[path] = RowwiseParallel(output_layouts=between, use_local_output=local_out, **whole)
        elif style == "rowwise_partial":  # a LoRA layer's part: its parent reduces base + adapter once
            styles[path] = RowwiseParallel(output_layouts=Partial(), use_local_output=False)
        elif style == "lora_rowwise":
            styles[path] = PrepareModuleOutput(
                output_layouts=Partial(), desired_output_layouts=between, use_local_output=local_out
            )
        elif style == "replicated_linear":
            styles[path] = ReplicatedLinear()
        elif style == "vocab" and isinstance(module, nn.Embedding):
            styles[path] = RowwiseParallel(
                input_layouts=Replicate(), output_layouts=between, use_local_output=local_out
            )
        elif style == "vocab":  # the output head: logits split by vocabulary, gathered unless the loss is parallel
            logits = Shard(-1) if vocab_parallel_loss else Replicate()
            styles[path] = ColwiseParallel(
                input_layouts=between, output_layouts=logits, use_local_output=not vocab_parallel_loss
            )
        elif style == "head_norm":  # on this rank's heads: [..., heads, head_dim], split by heads
            styles[path] = SequenceParallel(sequence_dim=-2, use_local_output=True)
        elif style == "norm" and sp:
            styles[path] = SequenceParallel()
        elif style == "experts":
            own = dict(module.named_parameters(recurse=False))
            packed = tuple(n for n in own if module_style(f"{path}.{n}", table) == "packed_colwise")
            styles[path] = ExpertsParallel(
                packed, tuple(n for n in own if module_style(f"{path}.{n}", table) == "rowwise")
            )
            fused.update({f"{path}.{n}": (PACKED_PARTS, own[n].ndim - 2) for n in packed})
    for region in regions:
        styles[region] = RegionInput(between)
    for block in moe_blocks(table, styles):
        styles[block] = MoeBlock(between, local_out)
    # Tied parameters (the output head's weight is the input embedding's): re-tied after the split.
    return FamilyPlan(styles, fused, [], tied_parameters(model))


def tied_parameters(model: nn.Module) -> list[tuple[str, str, str]]:
    """(alias module path, attribute, owner parameter name) of each tied parameter, found by identity."""
    owners: dict[int, str] = {}
    tied = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in owners:
            path, _, attr = name.rpartition(".")
            tied.append((path, attr, owners[id(param)]))
        else:
            owners[id(param)] = name
    return tied


def _gpt2_plan(model: nn.Module, degree: int, sp: bool) -> FamilyPlan:
    between, local_out = _sequence(sp)
    styles: dict[str, ParallelStyle] = {
        "transformer.wte": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=between, use_local_output=local_out
        ),
    }
    if sp:
        # Position embeddings stay replicated; their output is cut to this rank's tokens (no traffic).
        styles["transformer.wpe"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        )
        styles["transformer.ln_f"] = SequenceParallel()
    fused: dict[str, tuple[int, int]] = {}
    attrs = []
    for i, block in enumerate(blocks_of(model, "transformer.h")):
        path = f"transformer.h.{i}"
        styles[f"{path}.attn.c_attn"] = Conv1DColwise(fused_parts=3)
        styles[f"{path}.attn.c_proj"] = Conv1DRowwise(output_layouts=between, use_local_output=local_out)
        styles[f"{path}.mlp.c_fc"] = Conv1DColwise()
        styles[f"{path}.mlp.c_proj"] = Conv1DRowwise(output_layouts=between, use_local_output=local_out)
        for sub in ("attn", "mlp"):  # as in _llama_plan: one reduction of the input gradient
            styles[f"{path}.{sub}"] = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),))
        if sp:
            for norm in ("ln_1", "ln_2"):
                styles[f"{path}.{norm}"] = SequenceParallel()
        fused[f"{path}.attn.c_attn.weight"] = (3, 1)
        fused[f"{path}.attn.c_attn.bias"] = (3, 0)
        attrs += gpt2_local_heads(path, block, degree)
    styles["lm_head"] = ColwiseParallel(input_layouts=between, output_layouts=Replicate())
    tied = []
    if getattr(model.config, "tie_word_embeddings", True):
        tied.append(("lm_head", "weight", "transformer.wte.weight"))
    return FamilyPlan(styles, fused, attrs, tied)


# Families whose engine plan is written by hand (their linears are not nn.Linear); every other family
# runs ``table_plan`` from its tensor table.
FAMILY_PLANS: dict[str, Callable[[nn.Module, int, bool], FamilyPlan]] = {"gpt2": _gpt2_plan}


def check_splittable(model: nn.Module, parts: int, families=None, table: TensorTable | None = None) -> str:
    """The model's family, after checking that heads, vocabulary and every split parameter divide
    into ``parts``.

    Args:
        families: the families allowed (None: any with a tensor table).
        table: the model's tensor table, whose ``local_shape`` each parameter must have (None: not checked).

    Raises:
        TensorParallelError: an unsupported family, or heads / vocabulary / a split dimension not divisible.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "")
    if families is not None and model_type not in families:
        raise TensorParallelError(
            f"this tensor-parallel mode supports the transformers families {sorted(families)}; this model is "
            f"{type(model).__name__} (model_type {model_type!r}); set parallel.tensor.degree: 1 for it"
        )
    heads = getattr(config, "num_attention_heads", 0)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    sizes = (("heads", heads), ("key/value heads", kv_heads), ("vocabulary", getattr(config, "vocab_size", 0)))
    problems = [f"{what} {value}" for what, value in sizes if value % parts]
    if problems:
        raise TensorParallelError(
            f"the tensor split into {parts} parts must divide the model's {', '.join(problems)}; "
            "choose a tensor degree that divides them"
        )
    if table is not None:
        for name, param in model.named_parameters():
            try:
                local_shape(name, list(param.shape), model_type, parts, "1d", table)
            except ValueError as error:
                raise TensorParallelError(str(error)) from None
    return model_type


def family_plan(
    model: nn.Module,
    degree: int,
    sequence_parallel: bool,
    vocab_parallel_loss: bool = False,
    table: TensorTable | None = None,
) -> FamilyPlan:
    """The 1-D tensor-parallel plan of ``model`` from its tensor table.

    Args:
        vocab_parallel_loss: the logits stay split by vocabulary (a DTensor) for ``loss_parallel``;
            otherwise they are gathered whole before the model's loss.
        table: the plan's record of the model's tensor table (empty or None: read from the model).

    Raises:
        TensorParallelError: no tensor table for the model, or sizes not divisible by ``degree``.
    """
    if not table:
        table, why = model_tensor_table(model)
        if why:
            raise TensorParallelError(f"tensor parallelism cannot run this model: {why}; set parallel.tensor.degree: 1")
    problems = unknown_styles(table)
    if problems:
        raise TensorParallelError(
            f"model.tensor_layout: unknown styles {', '.join(problems)} (known: {', '.join(MODULE_STYLES)})"
        )
    model_type = check_splittable(model, degree, None, table)
    if model_type not in FAMILY_PLANS:
        return table_plan(model, table, sequence_parallel, vocab_parallel_loss)
    plan = FAMILY_PLANS[model_type](model, degree, sequence_parallel)
    if vocab_parallel_loss:
        between, _ = _sequence(sequence_parallel)
        plan.styles["lm_head"] = ColwiseParallel(
            input_layouts=between, output_layouts=Shard(-1), use_local_output=False
        )
    return plan
