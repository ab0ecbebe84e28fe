"""`profile_model`: build a model on the meta device, trace it, and write down a ModelProfile.

Six traced forward+backward passes, all on meta tensors (no weights, any model size): two batch
sizes give activation memory as a line in the micro-batch size, plain, with every block checkpointed,
and with every block checkpointed selectively (torchtitan's per-op policy). The first plain pass also gives the access trace, the first-use order of the
parameters, FLOPs and the per-block statistics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from elixir_tune.dtypes import DTYPE_ALIASES, TORCH_DTYPES, dtype_name
from elixir_tune.models.kv_cache import disable_kv_cache
from elixir_tune.models.lora import LoraError, apply_lora, lora_settings
from elixir_tune.models.model_output import find_loss
from elixir_tune.models.stage_plans import pipeline_problem
from elixir_tune.models.tensor_table import model_tensor_table
from elixir_tune.plan.capabilities import unsupported_layouts
from elixir_tune.plan.fingerprint import model_fingerprint
from elixir_tune.plan.schema import Dtype, ForeignRead, LayoutName
from elixir_tune.profiler.arch import model_arch, token_vocab
from elixir_tune.profiler.blocks import checkpointed, find_block_list
from elixir_tune.profiler.meta_kernels import FusedKernelsOnMeta
from elixir_tune.profiler.meter import LiveMemoryMeter, MetaOpCache
from elixir_tune.profiler.schema import ActivationLine, BlockInfo, ModelProfile, ParamInfo, SelectiveLine
from elixir_tune.profiler.source import ModelSource, ModelSourceError, load_model_source, quiet_transformers
from elixir_tune.profiler.trace import FORWARD, AccessRecorder, BlockStats, Step, ordered_trace
from elixir_tune.units import gib

CHECKPOINTING = ("none", "all")
DEFAULT_SEQ_LEN = 1024


@dataclass
class _Pass:
    """What one traced forward+backward measured."""

    steps: list[Step]
    peak_bytes: int
    flops: float
    block_fwd_flops: dict[int, float]
    blocks: list[BlockStats]
    pointwise_bytes: int
    foreign: dict[nn.Module, dict[int, None]]


def profile_model(
    source: ModelSource | str,
    batch_size: int = 8,
    seq_len: int | None = None,
    dtype: str = "fp32",
    checkpointing: str = "none",
    progress: Callable[[str], None] | None = None,
    lora: dict[str, Any] | None = None,
) -> ModelProfile:
    """Profiles a model on the meta device.

    Args:
        source: a ModelSource or a spec for load_model_source (file.py, file.py:builder, a model
            YAML or a config name).
        batch_size: micro-batch size of the traced example (activation memory is also given
            for any other size, as a line).
        seq_len: tokens per sample; default: the model YAML's seq_len, else 1024 or the model's positions
            when it has fewer.
        dtype: compute dtype, fp32, bf16 or fp16 (parameters are cast to it for tracing).
        checkpointing: "all" also records the access trace with every block checkpointed;
            activation memory with checkpointing is measured either way.
        progress: called with a short description before each stage.
        lora: LoRA adapters to add before tracing (``elixir_tune.models.lora.apply_lora``'s keyword
            arguments: rank, alpha, dropout, target_modules): the base is then frozen, and the
            profile (so the search) sees a frozen base and trainable adapters.

    Returns:
        The profile.

    Raises:
        ModelSourceError: bad spec, builder failure, forward without a loss, unsupported dtype.
    """
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in TORCH_DTYPES:
        raise ModelSourceError(f"unsupported dtype {dtype!r}: use one of {', '.join(TORCH_DTYPES)}")
    if checkpointing not in CHECKPOINTING:
        raise ModelSourceError(f"unsupported checkpointing {checkpointing!r}: use one of {', '.join(CHECKPOINTING)}")
    if batch_size < 1:
        raise ModelSourceError(f"batch size must be at least 1, got {batch_size}")
    report = progress or (lambda message: None)
    if not isinstance(source, ModelSource):
        source = load_model_source(source)
    if not seq_len:  # the model's own length, else the default within the model's positions
        seq_len = source.default_seq_len or min(DEFAULT_SEQ_LEN, source.max_seq_len or DEFAULT_SEQ_LEN)
    if source.max_seq_len and seq_len > source.max_seq_len:
        # Meta tensors hold no indices, so an out-of-range position would go unnoticed here.
        raise ModelSourceError(
            f"{source.source}: seq_len {seq_len} is longer than the model's {source.max_seq_len} positions"
        )

    report(f"building {source.name} on the meta device")
    model = _build_on_meta(source)
    disable_kv_cache(model)
    if lora:
        try:
            with torch.device("meta"):
                model = apply_lora(model, **lora)
        except (LoraError, TypeError) as error:
            raise ModelSourceError(f"{source.source}: {error}") from error
    fingerprint = model_fingerprint(model)
    built_dtypes = [p.dtype for p in model.parameters()]
    model.to(TORCH_DTYPES[dtype])
    model.train()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    param_pos = {id(p): i for i, p in enumerate(params)}
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    block_list, block_modules = find_block_list(model)

    sizes = (batch_size, 2 * batch_size)
    tracer = _Tracer(model, source, seq_len, TORCH_DTYPES[dtype], param_pos, block_modules, MetaOpCache())
    plain, ckpt, selective = [], [], []
    for b in sizes:
        report(f"tracing forward+backward at batch {b}")
        plain.append(tracer.run(b, checkpoint_blocks=False))
    for b in sizes if block_modules else ():
        report(f"tracing forward+backward at batch {b}, blocks checkpointed")
        ckpt.append(tracer.run(b, checkpoint_blocks=True))
    for b in sizes if block_modules else ():
        report(f"tracing forward+backward at batch {b}, blocks checkpointed selectively")
        selective.append(tracer.run(b, checkpoint_blocks=True, selective=True))

    order = _first_use_order(plain[0].steps, len(params))
    new_index = {pos: rank for rank, pos in enumerate(order)}

    def trace_of(result: _Pass) -> list[list[int]]:
        steps = [step for step in result.steps if step.params]  # modules that touch no parameter
        return [[new_index[p] for p in step.params] for step in ordered_trace(steps)]

    param_infos = [
        ParamInfo(
            name=named[pos][0],
            shape=list(params[pos].shape),
            dtype=dtype_name(built_dtypes[pos]),
            numel=params[pos].numel(),
            shared=owners[id(params[pos])] > 1,
            requires_grad=params[pos].requires_grad,
        )
        for pos in order
    ]
    blocks = _block_infos(block_modules, param_pos, new_index, plain, sizes)
    activation = _line(plain, sizes)
    activation_ckpt = _line(ckpt, sizes) if ckpt else None
    num_params = sum(p.numel for p in param_infos)
    buffers_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    arch = model_arch(model)
    arch.tensor_layout, tensor_problem = model_tensor_table(model)
    profile = ModelProfile(
        name=source.name,
        source=source.source,
        fingerprint=fingerprint,
        num_params=num_params,
        dtype=cast(Dtype, dtype),  # checked against TORCH_DTYPES above
        batch_size=batch_size,
        seq_len=seq_len,
        params=param_infos,
        trace=trace_of(plain[0]),
        trace_checkpointed=trace_of(ckpt[0]) if ckpt and checkpointing == "all" else [],
        flops_per_sample=plain[0].flops / batch_size,
        activation=activation,
        block_list=block_list,
        blocks=blocks,
        recompute_flops_per_sample=(ckpt[0].flops - plain[0].flops) / batch_size if ckpt else 0.0,
        pointwise_bytes_per_sample=plain[0].pointwise_bytes / batch_size,
        recompute_pointwise_bytes_per_sample=(
            max(0, ckpt[0].pointwise_bytes - plain[0].pointwise_bytes) / batch_size if ckpt else 0.0
        ),
        activation_checkpointed=activation_ckpt,
        selective=_selective_line(selective, plain[0], sizes) if selective else None,
        buffers_bytes=buffers_bytes,
        prologue_bytes_per_sample=_prologue_per_sample(plain, sizes),
        arch=arch,
        unsupported_layouts=cast(
            "dict[LayoutName, str]",
            unsupported_layouts(
                arch.model_type,
                hasattr(model, "lm_head"),
                tensor_problem,
                pipeline_problem=pipeline_problem(model),
            ),
        ),
        foreign_reads=_foreign_reads(model, [*plain, *ckpt, *selective], [named[pos][0] for pos in order], new_index),
        lora=lora_settings(model) if lora else {},
        inputs=_input_names(source, seq_len),
        max_seq_len=source.max_seq_len or 0,
        token_vocab=token_vocab(model),
    )
    profile.summary = summarize(profile)
    return profile


def _input_names(source: ModelSource, seq_len: int) -> list[str]:
    """The keys of the model's example batch (built on meta: no memory)."""
    with torch.device("meta"):
        return [str(key) for key in source.example_batch(1, seq_len)]


def summarize(profile: ModelProfile) -> str:
    """The human header of a profile: name, parameters, FLOPs per token, activation per sample."""
    shared = sum(p.shared for p in profile.params)
    lines = [
        f"{profile.name}: {profile.num_params:,} parameters"
        + (f" ({shared} shared, counted once)" if shared else "")
        + (f", {len(profile.blocks)} blocks in {profile.block_list}" if profile.blocks else ", no repeated blocks"),
        f"{profile.dtype}, seq_len {profile.seq_len}: "
        f"{profile.flops_per_token / 1e9:.3f} GFLOP per token (forward+backward)",
        f"activations per sample: {profile.activation.per_sample_bytes:,} bytes ({gib(profile.activation.per_sample_bytes, decimals=3)})"
        + (
            f", {profile.activation_checkpointed.per_sample_bytes:,} bytes with every block checkpointed"
            if profile.activation_checkpointed
            else ""
        )
        + (f", {profile.selective.activation.per_sample_bytes:,} selectively" if profile.selective is not None else ""),
        f"made by: elixir-tune profile {profile.source} --batch-size {profile.batch_size} --seq-len {profile.seq_len}"
        f" --dtype {profile.dtype}" + (" --checkpointing all" if profile.trace_checkpointed else ""),
    ]
    return "\n".join(lines)


class _WhereRunning:
    """Follows which module of ``model`` is running, to say where a traced pass failed."""

    def __init__(self, model: nn.Module):
        self._names = {module: name or "<model>" for name, module in model.named_modules()}
        self.stack: list[nn.Module] = []
        self.last_started: nn.Module | None = None
        self._handles: list = []

    def __enter__(self) -> _WhereRunning:
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._enter_module),
            nn.modules.module.register_module_forward_hook(self._leave_module),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _enter_module(self, module: nn.Module, args) -> None:
        if module in self._names:
            self.stack.append(module)
            self.last_started = module

    def _leave_module(self, module: nn.Module, args, output) -> None:
        if self.stack and self.stack[-1] is module:
            self.stack.pop()

    def describe(self, in_backward: bool) -> str:
        """Where the pass stopped: the innermost running module, or the last one started."""
        module = self.stack[-1] if self.stack else self.last_started
        where = f"{self._names[module]} ({type(module).__name__})" if module is not None else "the model"
        if in_backward:
            return f"the backward pass (the last module run, possibly recomputed, was {where})"
        return f"the forward of {where}"


def _build_on_meta(source: ModelSource) -> nn.Module:
    with torch.device("meta"):
        model = source.build_model()
    if any(not p.is_meta for p in model.parameters()) or any(not b.is_meta for b in model.buffers()):
        model = model.to("meta")  # the builder placed tensors on a device explicitly
    return model


@dataclass
class _Tracer:
    """Runs traced forward+backward passes of one model (meta, cast to the compute dtype)."""

    model: nn.Module
    source: ModelSource
    seq_len: int
    dtype: torch.dtype
    param_pos: dict[int, int]
    block_modules: list[nn.Module]
    op_cache: MetaOpCache

    def run(self, batch_size: int, checkpoint_blocks: bool, selective: bool = False) -> _Pass:
        """One forward+backward at ``batch_size``, every block checkpointed (fully or ``selective``) or none."""
        with torch.device("meta"):
            batch = self.source.example_batch(batch_size, self.seq_len)
        batch = {k: _to_meta(v, self.dtype) for k, v in batch.items()}
        inputs = [v for v in batch.values() if isinstance(v, torch.Tensor)]
        meter = LiveMemoryMeter([*self.model.parameters(), *self.model.buffers(), *inputs], self.op_cache)
        recorder = AccessRecorder(self.model, self.param_pos, self.block_modules, meter)
        # The engine moves each gradient into its chunk as soon as it is complete, so a finished
        # gradient is not activation memory: drop it as the engine would.
        handles = [p.register_post_accumulate_grad_hook(_drop_grad) for p in self.model.parameters() if p.requires_grad]
        blocks = (
            checkpointed(self.block_modules, FusedKernelsOnMeta, selective)
            if checkpoint_blocks
            else contextlib.nullcontext()
        )
        where = _WhereRunning(self.model)
        try:
            # The attention mode is left before backward (a torch-function mode would swallow the
            # whole backward call); checkpointed blocks enter it again when they recompute.
            with quiet_transformers(), meter, blocks, where:
                with FusedKernelsOnMeta(partial(_count_dropout_scores, meter, recorder)):
                    loss = _loss_of(self.source, self.model, batch)
                meter.in_backward = True
                loss.backward()
                del loss
        except ModelSourceError:
            raise
        except Exception as exc:  # the model ran its own code: anything may come out of it
            first_line = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else ""
            raise ModelSourceError(
                f"{self.source.source}: profiling stopped in {where.describe(meter.in_backward)}"
                + (f" with every block checkpointed{' selectively' * selective}" if checkpoint_blocks else "")
                + f": {type(exc).__name__}: {first_line}. The profiler runs the model on the meta device (shapes, "
                "no values): an operation that reads tensor values (.item(), nonzero, data-dependent shapes) or "
                "has no meta kernel cannot be traced there; make that module's forward shape-only, or report "
                "this message if the model trains in plain PyTorch"
            ) from exc
        finally:
            recorder.remove()
            for handle in handles:
                handle.remove()
        return _Pass(
            recorder.steps,
            meter.peak_bytes,
            meter.flops,
            dict(meter.block_fwd_flops),
            recorder.blocks,
            meter.pointwise_bytes,
            recorder.foreign,
        )


def _loss_of(source: ModelSource, model: nn.Module, batch: dict) -> torch.Tensor:
    out = model(**batch)  # what it raises is located and explained by the caller
    loss = find_loss(out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ModelSourceError(
            f"{source.source}: the forward did not return a loss (model(**batch) gave {type(out).__name__}, "
            f"loss {got}); return a scalar loss tensor, an object with .loss or a tuple with one scalar loss "
            "(for transformers models, pass labels in example_batch)"
        )
    if not loss.requires_grad:
        raise ModelSourceError(f"{source.source}: the loss does not require grad (are all parameters frozen?)")
    return loss


def _count_dropout_scores(meter: LiveMemoryMeter, recorder: AccessRecorder, elements: int) -> None:
    """Adds a fused attention call's dropout score elements to the block running it."""
    if meter.block is not None:
        recorder.blocks[meter.block].dropout_scores += elements


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def _to_meta(value, dtype: torch.dtype):
    if not isinstance(value, torch.Tensor):
        return value
    value = value.to("meta")
    return value.to(dtype) if value.is_floating_point() else value


def _foreign_reads(
    model: nn.Module, passes: list[_Pass], names: list[str], new_index: dict[int, int]
) -> list[ForeignRead]:
    """The foreign reads of every pass, by reading module (in model order), parameters in profile order."""
    module_names = {module: name for name, module in model.named_modules()}
    found: dict[nn.Module, set[int]] = {}
    for result in passes:
        for reader, positions in result.foreign.items():
            found.setdefault(reader, set()).update(new_index[pos] for pos in positions)
    return [
        ForeignRead(module=name, params=[names[index] for index in sorted(found[module])])
        for module, name in module_names.items()
        if module in found
    ]


def _first_use_order(steps: list[Step], num_params: int) -> list[int]:
    seen: dict[int, None] = {}
    for step in steps:
        if step.kind == FORWARD:
            for pos in step.params:
                seen.setdefault(pos, None)
    return [*seen, *(pos for pos in range(num_params) if pos not in seen)]


def _block_infos(
    block_modules: list[nn.Module],
    param_pos: dict[int, int],
    new_index: dict[int, int],
    plain: list[_Pass],
    sizes: tuple[int, int],
) -> list[BlockInfo]:
    infos = []
    delta = sizes[1] - sizes[0]
    for i, block in enumerate(block_modules):
        indices = sorted(new_index[param_pos[id(p)]] for p in block.parameters())
        retained = [result.blocks[i].retained_bytes for result in plain]
        infos.append(
            BlockInfo(
                index=i,
                first_param=indices[0] if indices else 0,
                num_params=len(indices),
                fwd_flops_per_sample=plain[0].block_fwd_flops.get(i, 0.0) / sizes[0],
                activation_bytes_per_sample=max(0, (retained[1] - retained[0]) // delta),
                boundary_bytes_per_sample=plain[0].blocks[i].boundary_bytes // sizes[0],
                dropout_scores_per_sample=plain[0].blocks[i].dropout_scores // sizes[0],
            )
        )
    return infos


def _prologue_per_sample(results: list[_Pass], sizes: tuple[int, int]) -> int:
    """One sample's activation bytes live when block 0 began (0 without blocks)."""
    if not results[0].blocks:
        return 0
    return max(0, (results[1].blocks[0].entry_bytes - results[0].blocks[0].entry_bytes) // (sizes[1] - sizes[0]))


def _selective_line(results: list[_Pass], plain: _Pass, sizes: tuple[int, int]) -> SelectiveLine:
    """What the selective passes kept (their activation line) and ran again beyond the plain pass."""
    return SelectiveLine(
        activation=_line(results, sizes),
        recompute_flops_per_sample=max(0.0, results[0].flops - plain.flops) / sizes[0],
        recompute_pointwise_bytes_per_sample=max(0, results[0].pointwise_bytes - plain.pointwise_bytes) / sizes[0],
    )


def _line(results: list[_Pass], sizes: tuple[int, int]) -> ActivationLine:
    per_sample = max(0, (results[1].peak_bytes - results[0].peak_bytes) // (sizes[1] - sizes[0]))
    fixed = max(0, results[0].peak_bytes - per_sample * sizes[0])
    return ActivationLine(fixed_bytes=fixed, per_sample_bytes=per_sample)
