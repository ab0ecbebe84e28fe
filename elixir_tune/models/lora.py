"""LoRA adapters through PEFT on the chunk engine.

``apply_lora`` wraps a model with PEFT's LoRA (``get_peft_model``): the base model's parameters
are frozen (requires_grad False) and small adapter matrices ``lora_A`` / ``lora_B`` are added to
the target modules. The profiler, the search and the engine then see a model whose base is frozen:
it goes into frozen chunks (compute dtype only, no master, gradient or optimizer state, sharded and
offloadable like any chunk) and only the adapters train (docs/finetune-data.md, "Frozen chunks").

Names: PEFT renames the base model's parameters (``base_model.model.`` in front, ``.base_layer``
inside each adapted module); ``base_name`` maps them back to the checkpoint's, so
``setup(weights=DIR)`` reads a Hugging Face directory into the frozen base, and adapter parameters,
which no checkpoint holds, start as PEFT starts them (``adapter_init``: A Kaiming-uniform, B zero)
from a seed, the same on every rank.

Out: ``save_adapter`` writes PEFT's adapter format (``adapter_config.json`` +
``adapter_model.safetensors``) that ``PeftModel.from_pretrained(base, DIR)`` reads;
``save_merged`` writes a full Hugging Face directory with the adapters merged into the weights.
Both gather on rank 0 (from every data shard, pipeline stage and tensor rank) and write there;
every rank must call them. They keep ``save_pretrained``'s promise: the files are staged in
``DIR/.elixir-save.tmp`` and renamed into place when complete, so a failed save leaves DIR as it was,
and every rank raises the same ``SaveError`` (no rank is left waiting, none returns as if it worked). Under pipeline and tensor plans a PEFT model's stage plan and tensor
table come from ``lora_layout.py``.

PEFT is imported only when a model is wrapped or saved (it is in the ``finetune`` extra).
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from elixir_tune.models.lora_layout import ADAPTER_NAME, base_name, is_adapter_name


class LoraError(ValueError):
    """LoRA settings or a model that LoRA cannot be used with; the message says what to change."""


def _peft():
    try:
        import peft
    except ImportError as error:  # pragma: no cover - peft is in the test and finetune extras
        raise LoraError(
            "LoRA needs the peft package: pip install 'elixir-tune[finetune]' (or pip install peft)"
        ) from error
    return peft


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float | None = None,
    dropout: float = 0.0,
    target_modules: Sequence[str] | str | None = None,
) -> nn.Module:
    """Wraps ``model`` with LoRA adapters (PEFT's ``get_peft_model``); the base is frozen.

    Works on a model with real weights and on one built on the meta device (the profiler's and a
    big model's ``setup(weights=DIR)`` path).

    Args:
        model: a transformers causal LM (or any module PEFT can adapt).
        rank: the adapters' rank r (at least 1).
        alpha: LoRA alpha (the update is scaled by alpha / rank); default 2 x rank.
        dropout: dropout on the adapters' input, in [0, 1).
        target_modules: names of the modules to adapt (``q_proj,v_proj``: a list or a comma-separated
            string); default PEFT's choice for the model's family (e.g. q_proj and v_proj for Llama).

    Returns:
        The PEFT model (``PeftModelForCausalLM`` for a causal LM); call it and hand it to ``setup``
        like the original.

    Raises:
        LoraError: a bad setting, or targets that match no module of the model.
    """
    if not isinstance(rank, int) or rank < 1:
        raise LoraError(f"LoRA rank must be a positive integer, got {rank!r}")
    if not 0.0 <= dropout < 1.0:
        raise LoraError(f"LoRA dropout must be in [0, 1), got {dropout}")
    alpha = float(2 * rank if alpha is None else alpha)
    if alpha <= 0:
        raise LoraError(f"LoRA alpha must be positive, got {alpha}")
    targets = parse_targets(target_modules)
    peft = _peft()
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        task_type="CAUSAL_LM" if hasattr(model, "generate") else None,
    )
    try:
        with warnings.catch_warnings():
            # PEFT calls transformers' deprecated is_gradient_checkpointing: a FutureWarning per rank, about
            # code the user cannot change.
            warnings.filterwarnings("ignore", category=FutureWarning)
            return peft.get_peft_model(model, config)
    except ValueError as error:  # PEFT: "Target modules {...} not found in the base model"
        raise LoraError(f"LoRA cannot adapt {type(model).__name__}: {error}") from error


def parse_targets(target_modules: Sequence[str] | str | None) -> list[str] | None:
    """``"q_proj, v_proj"`` or ``["q_proj", "v_proj"]`` -> ``["q_proj", "v_proj"]``; None stays None.

    Raises:
        LoraError: an empty list.
    """
    if target_modules is None:
        return None
    items = target_modules.split(",") if isinstance(target_modules, str) else list(target_modules)
    names = [str(item).strip() for item in items if str(item).strip()]
    if not names:
        raise LoraError("LoRA target modules: none given; name modules such as q_proj,v_proj or leave it out")
    return names


def lora_settings(model: nn.Module) -> dict[str, Any]:
    """The LoRA settings of a PEFT model, as a plan's ``model.lora`` records them; {} without adapters.

    Raises:
        LoraError: adapters PEFT made with another method than LoRA, or several adapters.
    """
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return {}
    if list(configs) != [ADAPTER_NAME]:
        raise LoraError(f"the model has adapters {sorted(configs)}; elixir-tune trains one, named {ADAPTER_NAME!r}")
    config = configs[ADAPTER_NAME]
    kind = str(getattr(config, "peft_type", ""))
    if not kind.endswith("LORA"):
        raise LoraError(f"the model's adapter is {kind or type(config).__name__}; elixir-tune trains LoRA adapters")
    targets = config.target_modules
    return {
        "rank": int(config.r),
        "alpha": float(config.lora_alpha),
        "dropout": float(config.lora_dropout),
        "target_modules": sorted(targets) if not isinstance(targets, str) else [targets],
    }


# --- adapters' first values ----------------------------------------------------------------------


def adapter_init(name: str, shape: Sequence[int], seed: int) -> torch.Tensor:
    """The first value of an adapter parameter, as PEFT starts it, from ``seed`` and its name alone.

    ``lora_B`` (and the embedding variant's A) start at zero, so the adapted model starts equal to
    the base; ``lora_A`` Kaiming-uniform (a = sqrt(5), nn.Linear's rule), as PEFT does. The same on
    every rank and at every world size.

    Args:
        name: the parameter's name in the PEFT model.
        shape: its shape.
        seed: the run's seed.

    Returns:
        An fp32 tensor of ``shape`` (CPU).
    """
    shape = tuple(int(s) for s in shape)
    if ".lora_B." in name or ".lora_embedding_A." in name:
        return torch.zeros(shape)
    if ".lora_magnitude_vector" in name:
        raise LoraError(f"{name}: DoRA's magnitude comes from the base weights; build the model with weights instead")
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    fan_in = shape[1] if len(shape) > 1 else shape[0]
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) on a (out, in) weight
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


# --- out ------------------------------------------------------------------------------------------


def _peft_model_of(model: nn.Module) -> Any:
    """The PEFT model (typed Any: PEFT's methods are not on nn.Module)."""
    inner = getattr(model, "module", model)  # an ElixirModel wraps the user's module
    if not lora_settings(inner):
        raise LoraError("the model has no LoRA adapters: build it with elixir_tune.models.lora.apply_lora")
    return inner


def _trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' fp32 values on rank 0 ({} elsewhere): gathered from the shards when ``model``
    runs on the engine (a collective then: every rank calls it)."""
    engine = getattr(model, "engine", None)
    if engine is not None:
        return _gatherer(engine).full_state_dict(trainable_only=True)
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters() if p.requires_grad}


def _gatherer(engine: Any) -> Any:
    """What gathers the whole model onto rank 0: a pipeline plan's stages (each stage's pieces over its
    data and tensor groups, then the stages merged), else the engine (its data and tensor groups)."""
    return engine.pipeline or engine


def save_adapter(model: nn.Module, out_dir: str | os.PathLike, base_model: str | None = None) -> None:
    """Writes the adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

    ``PeftModel.from_pretrained(base_model, out_dir)`` reads it. On the engine every rank must call
    it (the adapters are gathered from the shards); rank 0 writes, staged (``_write_staged``): a failed
    save leaves ``out_dir`` as it was, and every rank raises the same error.

    Args:
        model: the ``ElixirModel`` of a LoRA model (or the PEFT model itself).
        out_dir: directory to write (created).
        base_model: the base model's Hub name or directory, written as ``base_model_name_or_path`` (a
            model built from its config has none), so that ``AutoPeftModelForCausalLM.from_pretrained``
            finds it; None keeps what PEFT recorded.

    Raises:
        LoraError: the model has no LoRA adapters.
        SaveError: on every rank, when rank 0 could not write (the message names the rank, the file or
            directory and the cause).
    """
    peft_model = _peft_model_of(model)
    state = _trainable_state(model)
    if base_model is not None:
        for config in peft_model.peft_config.values():
            config.base_model_name_or_path = base_model

    def write(staging: Path) -> None:
        peft_model.save_pretrained(str(staging), state_dict=state, safe_serialization=True)
        _write_missing_adapters(staging, state)

    _write_staged(model, Path(out_dir), "save_adapter", write, replaces_model=False)


def _write_staged(
    model: nn.Module, out_dir: Path, caller: str, write: Callable[[Path], None], replaces_model: bool
) -> None:
    """Runs ``write(staging)`` on the writing rank, then agrees with every rank on the outcome.

    The contract of ``save_pretrained`` (engine/io/pretrained_files.py): the files go into
    ``out_dir/.elixir-save.tmp`` and reach disk there; only when all of them are complete are they
    renamed into ``out_dir``. A failure there (disk full, a file size limit, a path that is not a
    directory, PEFT's or transformers' own errors) is kept as one line; the staging files go, and the
    ranks exchange it (a collective, in place of a barrier), so that no rank returns while rank 0 is
    still writing and all of them raise the same error.

    Raises:
        SaveError: on every rank, with ``caller`` and the writing rank's failure.
    """
    # Imported here: the engine's weight reading imports this module's names (lora_layout), and a plain
    # PEFT model saved without the engine needs no process group.
    from elixir_tune.engine.io.pretrained_files import ExportDir, SaveError

    engine = getattr(model, "engine", None)
    world = engine.mesh.world if engine is not None else None
    export = None
    if world is None or world.rank == 0:
        export = ExportDir(out_dir, world.rank if world is not None else 0, replaces_model=replaces_model)
        export.prepare()
        if export.error is None:
            try:
                write(export.staging)
                _sync_files(export.staging)
            except Exception as failure:  # noqa: BLE001  (PEFT's, transformers' and safetensors' writers)
                export.fail(_failed_write(export, failure), failure)
        export.publish()
        if export.error is not None:
            export.abort()
    error = export.error if export is not None else None
    errors = [error] if error else []
    if world is not None:
        from elixir_tune.engine.comm import shared_errors

        errors = shared_errors(world, error)
    if errors:
        raise SaveError(f"{caller}: {'; '.join(errors)}")


def _sync_files(directory: Path) -> None:
    """Every file in ``directory`` on disk (a full disk can show only here), before the renames."""
    for path in sorted(directory.iterdir()):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _failed_write(export: Any, failure: BaseException) -> str:
    """What could not be done, for the error: the file under its final name when the failure names one."""
    filename = getattr(failure, "filename", None)
    if isinstance(filename, (str, os.PathLike)) and Path(filename).parent == export.staging:
        return f"write {export.final_path(Path(filename).name)}"
    return f"write {export.directory}"


def _write_missing_adapters(out_dir: Path, state: dict[str, torch.Tensor]) -> None:
    """PEFT writes the adapters of the LoRA layers the model holds; under a pipeline plan rank 0 holds
    its own stage's only (the others are stubs), so the weights file is written again from ``state``,
    the gathered adapters of every stage, under PEFT's names (the adapter name left out)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    weights = out_dir / "adapter_model.safetensors"
    wanted = {name.replace(f".{ADAPTER_NAME}.", "."): value for name, value in state.items()}
    with safe_open(str(weights), framework="pt") as written:
        if set(written.keys()) == set(wanted):
            return
        metadata = written.metadata()
    save_file({name: value.contiguous() for name, value in wanted.items()}, str(weights), metadata=metadata)


def merged_state_dict(full: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with each adapter merged into its weight (W + scale x B A).

    Args:
        full: the PEFT model's full state dict (names as ``model.state_dict()`` gives them).
        model: the PEFT model (its LoRA layers give each adapter's scale).

    Returns:
        Base names (``base_name``) -> fp32 tensors, adapters gone.

    Raises:
        LoraError: an adapted module that is not a linear layer (merging supports those).
    """
    merged = {base_name(name): value for name, value in full.items() if not is_adapter_name(name)}
    config = cast(Any, model).peft_config[ADAPTER_NAME]
    for module_name, scaling in _scalings(model, full).items():
        module = _module_or_none(model, module_name)
        lora_a = f"{module_name}.lora_A.{ADAPTER_NAME}.weight"
        lora_b = f"{module_name}.lora_B.{ADAPTER_NAME}.weight"
        weight = base_name(f"{module_name}.base_layer.weight")
        if lora_a not in full or lora_b not in full or weight not in merged or merged[weight].dim() != 2:
            raise LoraError(f"{module_name}: merging supports adapters on linear layers only; save the adapter instead")
        if getattr(module, "fan_in_fan_out", getattr(config, "fan_in_fan_out", False)):
            raise LoraError(f"{module_name}: fan_in_fan_out layers (GPT-2's Conv1D) are not merged; save the adapter")
        delta = (full[lora_b].float() @ full[lora_a].float()) * scaling
        merged[weight] = (merged[weight].float() + delta).to(merged[weight].dtype)
    return merged


def _module_or_none(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _scalings(model: Any, full: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each adapted module's scale (alpha / r) by its name: from the module where this rank holds it,
    else (a module of another pipeline stage, gone from this rank) from the adapter's config as PEFT's
    ``LoraLayer.update_layer`` computes it, with r from the gathered ``lora_A``'s shape.

    Raises:
        LoraError: a module of another stage under a config with per-module ranks or alphas.
    """
    scalings: dict[str, float] = {}
    for name, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and ADAPTER_NAME in scaling:
            scalings[name] = float(scaling[ADAPTER_NAME])
    config = model.peft_config[ADAPTER_NAME]
    suffix = f".lora_A.{ADAPTER_NAME}.weight"
    for name, value in full.items():
        module_name = name.removesuffix(suffix)
        if module_name == name or module_name in scalings:
            continue
        if getattr(config, "rank_pattern", None) or getattr(config, "alpha_pattern", None):
            raise LoraError(f"{module_name}: per-module LoRA ranks or alphas are not merged from a pipeline plan")
        rank = int(value.shape[0])
        scalings[module_name] = float(config.lora_alpha) / (math.sqrt(rank) if config.use_rslora else rank)
    return scalings


def save_merged(model: nn.Module, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Writes a full Hugging Face directory with the adapters merged into the base weights.

    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it without PEFT. Rank 0 holds the whole
    model on the CPU meanwhile (the other ranks nothing); every rank must call it. Rank 0 writes,
    staged as ``save_adapter`` does: a failed save leaves ``out_dir`` as it was (the earlier model
    loadable), and every rank raises the same error.

    Args:
        model: the ``ElixirModel`` of a LoRA model (or the PEFT model itself).
        out_dir: directory to write (created).
        dtype: dtype to store (default fp32).

    Raises:
        LoraError: the model has no LoRA adapters.
        SaveError: on every rank, when rank 0 could not merge or write (an adapter merging does not
            support, a full disk, a bad path: the message names the rank and the cause).
    """
    peft_model = _peft_model_of(model)
    if getattr(peft_model.peft_config[ADAPTER_NAME], "fan_in_fan_out", False):  # known on every rank: all raise
        raise LoraError("fan_in_fan_out layers (GPT-2's Conv1D) are not merged; save the adapter instead")
    engine = getattr(model, "engine", None)
    if engine is not None:
        full = _gatherer(engine).full_state_dict()
    else:
        full = {name: value.detach().float().cpu() for name, value in peft_model.state_dict().items()}

    def write(staging: Path) -> None:
        merged = merged_state_dict(full, peft_model)
        if dtype is not None:
            merged = {k: v.to(dtype) if v.is_floating_point() else v for k, v in merged.items()}
        peft_model.get_base_model().save_pretrained(str(staging), state_dict=merged, safe_serialization=True)

    _write_staged(model, Path(out_dir), "save_merged", write, replaces_model=True)
