"""Per-family tensor-parallel plans for unmodified transformers models (1-D, Megatron style).

Each family has one small table: which module is column- or row-parallel, which norms run
sequence-parallel, where activations change layout. The styles are ``parallelize_module``'s
(``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``) plus two
for GPT-2's ``Conv1D`` (weights stored ``[in, out]``, which torch's styles do not take) and a
per-head split of GPT-2's fused ``c_attn`` (q | k | v in one matrix): each rank keeps its own heads
of q, k and v, so its local piece is ``[q_r | k_r | v_r]``, not a contiguous third of the columns.

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

from torch import nn

from elixir_tune.engine.comm import (
    ColwiseParallel,
    DeviceMesh,
    DTensor,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    distribute_module,
)
from elixir_tune.engine.tp_layout import Layout, TensorParallelError

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


def _llama_plan(model: nn.Module, degree: int, sp: bool) -> FamilyPlan:
    base = model.base_model_prefix
    between, local_out = _sequence(sp)
    styles: dict[str, ParallelStyle] = {
        f"{base}.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=between, use_local_output=local_out
        ),
    }
    for i in range(len(blocks_of(model, f"{base}.layers"))):
        layer = f"{base}.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            styles[f"{layer}.self_attn.{proj}"] = ColwiseParallel()
        styles[f"{layer}.self_attn.o_proj"] = RowwiseParallel(output_layouts=between, use_local_output=local_out)
        for proj in ("gate_proj", "up_proj"):
            styles[f"{layer}.mlp.{proj}"] = ColwiseParallel()
        styles[f"{layer}.mlp.down_proj"] = RowwiseParallel(output_layouts=between, use_local_output=local_out)
        # The block input as a replicated DTensor (gathered from sequence shards with SP): the column-
        # parallel layers' input gradients (partial sums) then add up before ONE reduction, instead of
        # one all-reduce per q, k, v (gate, up) as with a plain input.
        styles[f"{layer}.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": between},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )
        styles[f"{layer}.mlp"] = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),))
        if sp:
            styles[f"{layer}.input_layernorm"] = SequenceParallel()
            styles[f"{layer}.post_attention_layernorm"] = SequenceParallel()
    if sp:
        styles[f"{base}.norm"] = SequenceParallel()
    styles["lm_head"] = ColwiseParallel(input_layouts=between, output_layouts=Replicate())
    tied = []
    if getattr(model.config, "tie_word_embeddings", False):
        tied.append(("lm_head", "weight", f"{base}.embed_tokens.weight"))
    return FamilyPlan(styles, {}, [], tied)


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


FAMILY_PLANS: dict[str, Callable[[nn.Module, int, bool], FamilyPlan]] = {
    "gpt2": _gpt2_plan,
    "llama": _llama_plan,
    "mistral": _llama_plan,
    "qwen2": _llama_plan,
}


def check_splittable(model: nn.Module, parts: int, families) -> str:
    """The model's family, after checking that heads and vocabulary split into ``parts``.

    Raises:
        TensorParallelError: an unsupported family, or heads / vocabulary not divisible.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "")
    if model_type not in families:
        raise TensorParallelError(
            f"tensor parallelism supports the transformers families {sorted(families)}; this model is "
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
    return model_type


def family_plan(
    model: nn.Module, degree: int, sequence_parallel: bool, vocab_parallel_loss: bool = False
) -> FamilyPlan:
    """The 1-D tensor-parallel plan of ``model`` (a transformers model of a supported family).

    Args:
        vocab_parallel_loss: the logits stay split by vocabulary (a DTensor) for ``loss_parallel``;
            otherwise they are gathered whole before the model's loss.

    Raises:
        TensorParallelError: an unsupported family, or heads / vocabulary not divisible by ``degree``.
    """
    model_type = check_splittable(model, degree, FAMILY_PLANS)
    plan = FAMILY_PLANS[model_type](model, degree, sequence_parallel)
    if vocab_parallel_loss:
        between, _ = _sequence(sequence_parallel)
        plan.styles["lm_head"] = ColwiseParallel(
            input_layouts=between, output_layouts=Shard(-1), use_local_output=False
        )
    return plan
