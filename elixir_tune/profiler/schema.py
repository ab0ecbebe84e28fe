"""The model profile: everything the cost model and search need to know about a model.

Written by `elixir-tune profile` (elixir_tune.profiler) and read by the cost model; hardware
independent. This module imports no torch, so a profile can be read on any machine.

Units: sizes of tensors in elements (``numel``), memory in bytes (``_bytes``), FLOPs in
floating-point operations (a multiply-add counts 2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from elixir_tune.files import InputFileError, load_yaml_mapping, problem
from elixir_tune.plan.capabilities import layout_reasons_of_type
from elixir_tune.plan.fields import NonNegativeFloat, NonNegativeInt, PositiveInt, build, check_fields
from elixir_tune.plan.schema import Dtype, ForeignRead, LayoutName

PROFILE_VERSION = 1


@dataclass
class ParamInfo:
    """One parameter.

    Attributes:
        name: its name in ``model.named_parameters()`` (the first name when shared).
        shape: its shape.
        dtype: fp32, bf16 or fp16 (the dtype it was built with).
        numel: number of elements.
        shared: used by several modules (tied embeddings); counted once.
        requires_grad: trained (False for frozen parameters).
    """

    name: str
    shape: list[NonNegativeInt]
    dtype: str
    numel: NonNegativeInt
    shared: bool = False
    requires_grad: bool = True


@dataclass
class BlockInfo:
    """One item of the model's repeated blocks (a transformer layer).

    Attributes:
        index: position in the block list.
        first_param: index into ModelProfile.params of the block's first parameter.
        num_params: how many consecutive parameters (in ModelProfile.params order) it owns.
        fwd_flops_per_sample: forward FLOPs for one sample at the profiled seq_len.
        activation_bytes_per_sample: activation memory the block keeps for backward, one sample.
        boundary_bytes_per_sample: the block's input, what checkpointing keeps, one sample.
        dropout_scores_per_sample: attention score elements (heads x query x key) of one sample that
            the block's fused attention computes with dropout: counted in neither figure above (a GPU
            keeps none of them), kept by a CPU device, whose attention takes the math path with
            dropout (``costmodel/memory.py`` ``cpu_attention_dropout_bytes``). 0 in older profiles.
    """

    index: NonNegativeInt
    first_param: NonNegativeInt
    num_params: NonNegativeInt
    fwd_flops_per_sample: NonNegativeFloat
    activation_bytes_per_sample: NonNegativeInt
    boundary_bytes_per_sample: NonNegativeInt
    dropout_scores_per_sample: NonNegativeInt = 0


@dataclass
class ActivationLine:
    """Activation memory as a line in the micro-batch size: fixed_bytes + per_sample_bytes * b.

    Attributes:
        fixed_bytes: the part that does not grow with the batch.
        per_sample_bytes: the part per sample at the profiled seq_len.
    """

    fixed_bytes: NonNegativeInt
    per_sample_bytes: NonNegativeInt

    def at(self, micro_batch_size: int) -> int:
        return self.fixed_bytes + self.per_sample_bytes * micro_batch_size


@dataclass
class SelectiveLine:
    """Every block checkpointed selectively (torchtitan's per-op policy, ``elixir_tune.selective_checkpoint``),
    traced on the meta device with the policy itself: what it keeps and what its backward runs again.

    Attributes:
        activation: peak activation memory over forward+backward.
        recompute_flops_per_sample: extra forward FLOPs of one sample: the matrix products the policy
            does not save (every other one); the attention and the saved products do not run again.
        recompute_pointwise_bytes_per_sample: the extra memory-bound pointwise bytes (norms,
            activations, rotary embedding, residual adds all run again).
    """

    activation: ActivationLine
    recompute_flops_per_sample: NonNegativeFloat = 0.0
    recompute_pointwise_bytes_per_sample: NonNegativeFloat = 0.0


@dataclass
class ModelArch:
    """The architecture numbers of a transformers model (its HF config), for tensor and pipeline
    parallelism: which parameters split how, and the cost model's per-layer communication and
    activation formulas. Zero (or "") when unknown: a custom model without an HF config, or a
    profile written before these were recorded.

    Attributes:
        model_type: the HF config's ``model_type`` (gpt2, llama, opt, ...).
        hidden_size: width of the residual stream (h).
        num_heads: attention heads.
        num_kv_heads: key/value heads (grouped-query attention; equal to num_heads otherwise).
        intermediate_size: width of the MLP's inner layer.
        vocab_size: vocabulary size.
        num_layers: transformer layers.
        tensor_layout: the model's tensor table (``plan/tensor_layout.py``: module pattern ->
            style), from its transformers ``base_model_tp_plan`` or the family's built-in table;
            empty when tensor parallelism cannot run it, or in profiles made before it was recorded.
        num_experts: experts per mixture-of-experts block when the config ships an expert plan
            (``config.base_model_ep_plan`` dispatching tokens to its experts); 0 otherwise: expert
            parallelism cannot run the model.
        experts_per_token: experts each token is routed to (top-k; 0 without an expert plan).
        attention_scores: the attention writes its seq x seq scores to memory (eager attention, no
            fused kernel); False for fused kernels (sdpa, FlashAttention) and when unknown.
    """

    model_type: str = ""
    hidden_size: NonNegativeInt = 0
    num_heads: NonNegativeInt = 0
    num_kv_heads: NonNegativeInt = 0
    intermediate_size: NonNegativeInt = 0
    vocab_size: NonNegativeInt = 0
    num_layers: NonNegativeInt = 0
    tensor_layout: dict[str, str] = field(default_factory=dict)
    num_experts: NonNegativeInt = 0
    experts_per_token: NonNegativeInt = 0
    attention_scores: bool = False


@dataclass
class ModelProfile:
    """A profile of one model at one seq_len and compute dtype.

    Attributes:
        name: model name.
        source: the model file or model YAML it was built from.
        fingerprint: same hash a plan carries (see elixir_tune.profiler.fingerprint).
        num_params: parameters, tied ones counted once.
        dtype: compute dtype the profile was traced in.
        batch_size: batch size of the traced example.
        seq_len: tokens per sample.
        params: every parameter, in first-use order (the order of the access trace).
        trace: forward then backward, one entry per operation: indices into ``params`` that the
            operation touches. No checkpointing.
        trace_checkpointed: the same with every block checkpointed (recomputation included);
            empty when the model has no blocks or it was not asked for.
        block_list: dotted path of the ModuleList of repeated blocks ("" when none).
        blocks: the repeated blocks.
        flops_per_sample: forward + backward FLOPs of one sample (no recomputation).
        recompute_flops_per_sample: extra forward FLOPs of one sample when every block recomputes.
        pointwise_bytes_per_sample: bytes written by memory-bound pointwise ops in one sample's
            forward + backward (``elixir_tune.pointwise``); 0 in profiles made before it was counted.
        recompute_pointwise_bytes_per_sample: the extra of it when every block recomputes.
        activation: peak activation memory over forward+backward, no checkpointing.
        prologue_bytes_per_sample: of it, one sample's activations live when the first block begins
            (the embeddings' output, a causal mask, the forward's locals: an upper bound of what a
            pipeline's first stage keeps for them); 0 in older profiles.
        activation_checkpointed: the same with every block checkpointed.
        selective: with every block checkpointed selectively (torchtitan's per-op policy); None in
            profiles made before it was traced, or without blocks.
        buffers_bytes: bytes of the model's buffers (not trained, kept on the device).
        summary: one-line human description.
        arch: the architecture numbers of its HF config (all zero for other models).
        unsupported_layouts: the parallel layouts (pipeline, tensor) the engine cannot run for this
            model, each with the reason (``plan/capabilities.py``); None in profiles made before it
            was recorded (``layout_reasons`` then derives it from the family).
        foreign_reads: trainable parameters a module reads in its forward while none of their
            owning modules runs (Mamba's mixer reads ``conv1d.weight``), by reading module; the
            trace counts them in the reader's steps. Empty in profiles made before they were found.
        lora: the LoRA settings the model was profiled with (``elixir_tune.models.lora.lora_settings``:
            rank, alpha, dropout, target_modules); empty for full fine-tuning. The plan copies it.
        inputs: the keys of the model's example batch, what its forward takes (``input_ids``,
            ``labels``, ...); the search names the command that feeds them. Empty in older profiles.
        token_vocab: the token ids the model's input takes (``arch.token_vocab``: the config's
            vocab_size, else its first embedding's rows); 0 when unknown or in older profiles.
        max_seq_len: the longest sequence the model's position table takes (its config's
            ``n_positions`` or ``max_position_embeddings``); 0 when unbounded, unknown or in older
            profiles. ``validate`` holds a plan's ``seq_len`` to it.
    """

    name: str
    source: str
    fingerprint: str
    num_params: NonNegativeInt
    dtype: Dtype
    batch_size: PositiveInt
    seq_len: PositiveInt
    params: list[ParamInfo]
    trace: list[list[NonNegativeInt]]
    flops_per_sample: NonNegativeFloat
    activation: ActivationLine
    trace_checkpointed: list[list[NonNegativeInt]] = field(default_factory=list)
    block_list: str = ""
    blocks: list[BlockInfo] = field(default_factory=list)
    recompute_flops_per_sample: NonNegativeFloat = 0.0
    pointwise_bytes_per_sample: NonNegativeFloat = 0.0
    recompute_pointwise_bytes_per_sample: NonNegativeFloat = 0.0
    activation_checkpointed: ActivationLine | None = None
    selective: SelectiveLine | None = None
    buffers_bytes: NonNegativeInt = 0
    prologue_bytes_per_sample: NonNegativeInt = 0
    summary: str = ""
    arch: ModelArch = field(default_factory=ModelArch)
    unsupported_layouts: dict[LayoutName, str] | None = None
    foreign_reads: list[ForeignRead] = field(default_factory=list)
    lora: dict[str, Any] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    token_vocab: NonNegativeInt = 0
    max_seq_len: NonNegativeInt = 0
    version: int = PROFILE_VERSION

    def layout_reasons(self) -> dict[str, str]:
        """The layouts the engine cannot run for this model, each with the reason."""
        if self.unsupported_layouts is not None:
            return {str(layout): why for layout, why in self.unsupported_layouts.items()}
        return layout_reasons_of_type(self.arch.model_type, self.arch.tensor_layout)

    @property
    def flops_per_token(self) -> float:
        return self.flops_per_sample / self.seq_len

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelProfile:
        """Builds a profile from its mapping.

        Raises:
            ValueError: the mapping is not a valid profile; the message lists every problem with
                its field path (types, bounds and choices come from the dataclasses above).
        """
        problems = profile_problems(raw)
        if problems:
            raise ValueError(f"{len(problems)} problem(s): " + "; ".join(problems))
        return build(cls, raw)


def profile_problems(raw: object) -> list[str]:
    """Every problem of a profile mapping, each with its field path; empty when it is valid."""
    if not isinstance(raw, dict):
        return [f"profile: expected a mapping, got {type(raw).__name__}"]
    errors: list[str] = []
    check_fields(raw, ModelProfile, "", errors)
    if not errors:
        _check_consistency(raw, errors)
    return errors


def _check_consistency(raw: dict, errors: list[str]) -> None:
    """Rules across a well-typed profile's fields: what the cost model and the search rely on."""
    params = raw["params"]
    total = sum(param["numel"] for param in params)
    if raw["num_params"] != total:
        errors.append(f"num_params: {raw['num_params']}, but the parameters listed hold {total}")
    if any(param.get("requires_grad", True) for param in params) and not raw["trace"]:
        errors.append("trace: empty, but the model has trainable parameters: no operation of the step reads them")
    if raw["trace"] and raw["flops_per_sample"] <= 0:
        errors.append("flops_per_sample: 0, but the trace records operations")
    for key in ("trace", "trace_checkpointed"):
        beyond = sorted({index for step in raw.get(key, []) for index in step if index >= len(params)})
        if beyond:
            errors.append(f"{key}: parameter index {beyond[0]} is beyond the {len(params)} parameters listed")
    for position, block in enumerate(raw.get("blocks", [])):
        if block["index"] != position:
            errors.append(f"blocks[{position}].index: expected {position}, got {block['index']}")
        if block["first_param"] + block["num_params"] > len(params):
            errors.append(f"blocks[{position}]: its parameters run beyond the {len(params)} listed")
    if raw.get("blocks") and not raw.get("block_list"):
        errors.append("block_list: empty, but blocks are listed")


def save_profile(profile: ModelProfile, path: str | Path) -> None:
    """Writes a profile as YAML, its summary as a comment header."""
    header = "".join(f"# {line}\n" for line in profile.summary.splitlines())
    Path(path).write_text(header + yaml.safe_dump(profile.to_dict(), sort_keys=False, width=120))


def load_profile(path: str | Path) -> ModelProfile:
    """Reads a profile written by save_profile.

    Raises:
        FileNotFoundError: no such file (run `elixir-tune profile MODEL` first).
        InputFileError: (a ValueError) the file is unreadable, not YAML, truncated or not a profile of
            this version; one line naming the file and the first problem.
    """
    path = Path(path)
    if not path.is_file() and not path.is_dir():
        raise FileNotFoundError(f"{path}: no profile; run `elixir-tune profile MODEL --out {path}` first")
    hint = "run `elixir-tune profile MODEL` again to rewrite it"
    raw = load_yaml_mapping(path, "profile", hint)
    if "version" not in raw:
        raise InputFileError(path, "not a profile: it has no version field (a truncated or different file)", hint)
    if raw["version"] != PROFILE_VERSION:
        raise InputFileError(
            path, f"profile version {raw['version']!r}; this elixir-tune reads version {PROFILE_VERSION}", hint
        )
    problems = profile_problems(raw)
    if problems:
        missing = [
            f.name
            for f in dataclasses.fields(ModelProfile)
            if f.name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        kind = f"profile (incomplete, truncated?: {len(missing)} required field(s) missing)" if missing else "profile"
        raise problem(path, problems, kind, hint)
    return build(ModelProfile, raw)
