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
all-reduces of partial sums), which is exact whatever it picks; docs/DESIGN.md 9.5 compares the bytes
it moves with SUMMA's (measured: about 1.3x on a small GPT-2).

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
)
from elixir_tune.engine.parallel.tp_layout import TensorParallelError

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


def _entry(fused_parts: int = 1) -> Linear2D:
    return Linear2D(ROW_SAMPLES, RESIDUAL, use_local_output=True, fused_parts=fused_parts)


def _exit() -> Linear2D:
    return Linear2D(RESIDUAL, RESIDUAL, use_local_output=False)


def _head() -> Linear2D:
    return Linear2D(RESIDUAL, REPLICATED, use_local_output=True)


def llama_grid_plan(model: nn.Module, q: int) -> FamilyPlan:
    base = model.base_model_prefix
    styles: dict[str, ParallelStyle] = {f"{base}.embed_tokens": Embedding2D(), f"{base}.norm": Norm2D()}
    for i in range(len(blocks_of(model, f"{base}.layers"))):
        layer = f"{base}.layers.{i}"
        styles[f"{layer}.input_layernorm"] = Norm2D()
        styles[f"{layer}.post_attention_layernorm"] = Norm2D()
        styles[f"{layer}.self_attn"] = LocalSamples()
        styles[f"{layer}.mlp"] = LocalSamples()
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            styles[f"{layer}.{proj}"] = _entry()
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            styles[f"{layer}.{proj}"] = _exit()
    styles["lm_head"] = _head()
    tied = []
    if getattr(model.config, "tie_word_embeddings", False):
        tied.append(("lm_head", "weight", f"{base}.embed_tokens.weight"))
    return FamilyPlan(styles, {}, [], tied)


def gpt2_grid_plan(model: nn.Module, q: int) -> FamilyPlan:
    styles: dict[str, ParallelStyle] = {
        "transformer.wte": Embedding2D(),
        # Position rows are shared by every sample: hidden split over the columns, broadcast over the batch.
        "transformer.wpe": Embedding2D((Replicate(), Shard(2)), split=False),
        "transformer.ln_f": Norm2D(),
    }
    fused: dict[str, tuple[int, int]] = {}
    attrs = []
    for i, block in enumerate(blocks_of(model, "transformer.h")):
        path = f"transformer.h.{i}"
        styles[f"{path}.ln_1"] = Norm2D()
        styles[f"{path}.ln_2"] = Norm2D()
        styles[f"{path}.attn"] = LocalSamples()
        styles[f"{path}.mlp"] = LocalSamples()
        styles[f"{path}.attn.c_attn"] = _entry(fused_parts=3)
        styles[f"{path}.mlp.c_fc"] = _entry()
        styles[f"{path}.attn.c_proj"] = _exit()
        styles[f"{path}.mlp.c_proj"] = _exit()
        fused[f"{path}.attn.c_attn.weight"] = (3, 1)
        fused[f"{path}.attn.c_attn.bias"] = (3, 0)
        attrs += gpt2_local_heads(path, block, q)
    styles["lm_head"] = _head()
    tied = []
    if getattr(model.config, "tie_word_embeddings", True):
        tied.append(("lm_head", "weight", "transformer.wte.weight"))
    return FamilyPlan(styles, fused, attrs, tied)


GRID_PLANS = {"gpt2": gpt2_grid_plan, "llama": llama_grid_plan, "mistral": llama_grid_plan, "qwen2": llama_grid_plan}


def grid_plan(model: nn.Module, degree: int) -> FamilyPlan:
    """The 2D (q x q) tensor-parallel plan of ``model``.

    Raises:
        TensorParallelError: not a square degree, an unsupported family, or heads / vocabulary /
            hidden size not divisible by q.
    """
    q = math.isqrt(degree)
    if q * q != degree or q < 2:
        raise TensorParallelError(f"2d tensor parallelism needs a square degree q x q >= 4, got {degree}")
    model_type = check_splittable(model, q, GRID_PLANS)
    hidden = getattr(model.config, "hidden_size", 0)
    if hidden % q:
        raise TensorParallelError(
            f"2d tensor parallelism on a {q} x {q} grid needs the hidden size {hidden} divisible by {q}"
        )
    return GRID_PLANS[model_type](model, q)
