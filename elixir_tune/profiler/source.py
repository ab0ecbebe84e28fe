"""Where a model comes from: a Python file with a builder, a model YAML naming a transformers
architecture, or a Hugging Face model directory (its ``config.json``; weights are not read here).

A Python file exposes ``build_model() -> nn.Module`` and ``example_batch(batch_size, seq_len) ->
dict[str, Tensor]``; ``file.py:other_builder`` names another builder. A model YAML (see
``configs/models/``) names a transformers ``model_type`` and its config fields; it is built with
``AutoModelForCausalLM.from_config``, so nothing is downloaded. A bare name such as ``gpt2-tiny``
is looked up in ``configs/models/``. A directory with a ``config.json`` (a downloaded model, or one
written by ``save_pretrained``) is built from that config the same way; its weights are loaded at
training time (``elixir_tune.setup(..., weights=DIR)``). A Hub name such as ``meta-llama/Llama-2-7b-hf``
is that model's directory in the local Hugging Face cache (elixir_tune/hf_cache.py; never downloaded).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elixir_tune.files import InputFileError, load_yaml
from elixir_tune.hf_cache import ModelNotCachedError, cached_model_dir, looks_like_hub_name
from elixir_tune.paths import MODEL_CONFIGS_DIR, split_model_spec


class ModelSourceError(ValueError):
    """The model cannot be loaded, built or run; the message says why."""


@dataclass
class ModelSource:
    """A model the profiler (and a training script) can build.

    Attributes:
        name: model name (the YAML's ``name`` or the file's stem).
        source: the spec it was loaded from, as given.
        default_seq_len: the seq_len to profile at when none is asked (YAML ``seq_len``), or None.
        vocab_size: vocabulary size for token-id batches (YAML models), or None.
        max_seq_len: the longest sequence the model takes (YAML models' position count), or None.
    """

    name: str
    source: str
    default_seq_len: int | None = None
    vocab_size: int | None = None
    max_seq_len: int | None = None
    _build: Callable[[], nn.Module] = field(default=None, repr=False)  # type: ignore[assignment]
    _batch: Callable[[int, int], dict] = field(default=None, repr=False)  # type: ignore[assignment]
    _builder_name: str = field(default="build_model", repr=False)

    def build_model(self) -> nn.Module:
        """Builds the model (real weights on CPU, or shapes only under ``torch.device("meta")``).

        Raises:
            ModelSourceError: the builder raised, or did not return an nn.Module.
        """
        try:
            model = self._build()
        except ModelSourceError:
            raise
        except Exception as exc:
            raise ModelSourceError(f"{self.source}: {self._builder_name}() raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(model, nn.Module):
            raise ModelSourceError(
                f"{self.source}: {self._builder_name}() returned {type(model).__name__}, not a torch.nn.Module"
            )
        return model

    def example_batch(self, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
        """One batch of inputs for ``model(**batch)``.

        Raises:
            ModelSourceError: example_batch raised or did not return a dict.
        """
        try:
            batch = self._batch(batch_size, seq_len)
        except Exception as exc:
            raise ModelSourceError(
                f"{self.source}: example_batch({batch_size}, {seq_len}) raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(batch, dict):
            raise ModelSourceError(
                f"{self.source}: example_batch() returned {type(batch).__name__}; it must return a dict "
                "of keyword arguments for model(**batch)"
            )
        return batch


def load_model_source(spec: str) -> ModelSource:
    """Resolves a model spec.

    Args:
        spec: ``path.py``, ``path.py:builder``, a model YAML path, a bare config name such as
            ``gpt2-tiny`` (looked up as ``configs/models/<name>.yaml``), a Hugging Face model directory,
            or a Hub name (``owner/name``) in the local Hugging Face cache.

    Returns:
        The ModelSource; nothing is built yet.

    Raises:
        ModelSourceError: missing file, no builder, unknown architecture, malformed YAML, a Hub name
            that is not in the local cache.
    """
    spec = str(spec)
    path_part, builder = split_model_spec(spec)
    path = Path(path_part)
    if path.is_dir():
        return _load_hf_directory(path, spec)
    if looks_like_hub_name(spec):  # owner/name: the local Hugging Face cache's snapshot, no network
        try:
            return _load_hf_directory(cached_model_dir(spec), spec, name=spec.rpartition("/")[2])
        except ModelNotCachedError as error:
            raise ModelSourceError(str(error)) from error
    if path.suffix in (".yaml", ".yml"):
        return _load_yaml(path, spec)
    if path.suffix == ".py":
        return _load_python(path, builder, spec)
    if "/" not in path_part and "\\" not in path_part:  # a config name ("opt-1.3b" has a dot, no extension)
        candidate = MODEL_CONFIGS_DIR / f"{path_part}.yaml"
        if candidate.is_file():
            return _load_yaml(candidate, spec)
        raise ModelSourceError(
            f"{spec}: no such model file and no config named {path_part!r}; known configs: "
            f"{', '.join(available_model_configs()) or '(none)'}"
        )
    raise ModelSourceError(
        f"{spec}: MODEL must be a .py file (optionally file.py:builder), a model .yaml, a config name, "
        "or a Hugging Face model directory (with config.json)"
    )


def check_model_source(spec: str) -> str:
    """Checks a model spec the way ``load_model_source`` would, without running any of its code.

    A plan names its model by ``model.source``; a plan received from someone else must be safe to
    validate, show and dry-run, so a Python file is read and parsed here, never imported: it must
    exist, parse, and define the builder and ``example_batch`` at its top level. A model YAML, a
    config name or a Hugging Face directory is data and is loaded as usual (no remote code).

    Args:
        spec: as for ``load_model_source``.

    Returns:
        The model's name (the file's stem for a Python file).

    Raises:
        ModelSourceError: what ``load_model_source`` would refuse and can be seen without importing.
    """
    spec = str(spec)
    path_part, builder = split_model_spec(spec)
    path = Path(path_part)
    if path.suffix != ".py" or path.is_dir():
        return load_model_source(spec).name
    if not path.is_file():
        raise ModelSourceError(f"{path}: no such file")
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError) as exc:
        raise ModelSourceError(f"{path}: not valid Python: {exc}") from exc
    defined = set()
    for node in tree.body:  # top-level definitions and assignments, as getattr(module, name) would find them
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(target.id for target in targets if isinstance(target, ast.Name))
    if builder not in defined:
        raise ModelSourceError(f"{path}: no builder function {builder}() (define it, or name one as {path}:my_builder)")
    if "example_batch" not in defined:
        raise ModelSourceError(f"{path}: no example_batch(batch_size, seq_len) function returning a dict of inputs")
    return path.stem


def available_model_configs() -> list[str]:
    """Names of the model YAMLs shipped in configs/models/."""
    return sorted(p.stem for p in MODEL_CONFIGS_DIR.glob("*.yaml"))


def _load_python(path: Path, builder: str, spec: str) -> ModelSource:
    if not path.is_file():
        raise ModelSourceError(f"{path}: no such file")
    module_name = f"_elixir_tune_model_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ModelSourceError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    # As `python model.py` would: the file's folder first on the import path, so that it imports the modules
    # beside it (at import, or later inside build_model) without PYTHONPATH=.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ModelSourceError(f"{path}: importing it raised {type(exc).__name__}: {exc}") from exc
    build = getattr(module, builder, None)
    if not callable(build):
        raise ModelSourceError(f"{path}: no builder function {builder}() (define it, or name one as {path}:my_builder)")
    batch = getattr(module, "example_batch", None)
    if not callable(batch):
        raise ModelSourceError(f"{path}: no example_batch(batch_size, seq_len) function returning a dict of inputs")
    return ModelSource(name=path.stem, source=spec, _build=build, _batch=batch, _builder_name=builder)


def _load_hf_directory(path: Path, spec: str, name: str | None = None) -> ModelSource:
    """A Hugging Face model directory: built from its config.json (the architecture is its model_type)."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelSourceError(
            f"{path}: a model directory needs a config.json (a Hugging Face model directory, as "
            "save_pretrained writes it)"
        )
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise ModelSourceError(f"{config_path}: not valid JSON: {exc}") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelSourceError(f"{config_path}: no model_type; is this a transformers model directory?")
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version")}
    raw = {"name": name or path.resolve().name, "architecture": config["model_type"], "config": fields}
    # The engine keeps fp32 master weights (the plan says the compute dtype); training keeps no KV cache.
    for key in ("dtype", "torch_dtype", "use_cache"):
        fields.pop(key, None)
    return _from_raw(raw, config_path, spec)


def _load_yaml(path: Path, spec: str) -> ModelSource:
    if not path.is_file():
        raise ModelSourceError(f"{path}: no such file")
    try:  # the one input loader: binary, non-UTF-8 or broken YAML is one line naming the file
        raw = load_yaml(path, "model YAML")
    except InputFileError as exc:
        raise ModelSourceError(str(exc)) from None
    if not isinstance(raw, dict) or "architecture" not in raw:
        raise ModelSourceError(
            f"{path}: a model YAML needs at least `architecture:` (a transformers model_type) and `config:`"
        )
    return _from_raw(raw, path, spec)


# A config's sizes, by transformers' common names (its attribute_map answers them for every family).
_SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings")


def _from_raw(raw: dict, path: Path, spec: str) -> ModelSource:
    """A transformers causal LM from ``architecture`` (model_type) and ``config`` fields."""
    architecture = str(raw["architecture"])
    config_fields = raw.get("config") or {}
    if not isinstance(config_fields, dict):
        raise ModelSourceError(f"{path}: `config:` must be a mapping of transformers config fields")
    from transformers import CONFIG_MAPPING  # deferred: importing transformers takes seconds

    if architecture not in CONFIG_MAPPING:
        close = [name for name in CONFIG_MAPPING.keys() if architecture.lower()[:3] in name][:8]
        raise ModelSourceError(
            f"{path}: unknown architecture {architecture!r} (not a transformers model_type)"
            + (f"; similar: {', '.join(close)}" if close else "")
        )
    attn_implementation = raw.get("attn_implementation", "sdpa")
    config_fields = {"use_cache": False, **config_fields}  # training keeps no KV cache

    def make_config() -> Any:
        from transformers import AutoConfig

        try:
            with quiet_transformers():
                return AutoConfig.for_model(architecture, **config_fields)
        except Exception as exc:
            raise ModelSourceError(f"{path}: config for {architecture!r} rejected: {exc}") from exc

    config = make_config()
    # transformers builds a model of -1 layers as one of none; the profile would plan an empty stack.
    for name in _SIZE_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ModelSourceError(f"{path}: config {name} is {value}; a model needs at least 1")
    if not getattr(config, "vocab_size", None):
        raise ModelSourceError(f"{path}: {architecture!r} has no vocab_size; model YAMLs are for token models")
    vocab_size = int(config.vocab_size)
    max_seq_len = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)

    def build() -> nn.Module:
        from transformers import AutoModelForCausalLM

        with quiet_transformers():
            try:
                return AutoModelForCausalLM.from_config(make_config(), attn_implementation=attn_implementation)
            except ValueError as exc:
                # A model without attention (Mamba) refuses any implementation asked of it: when
                # none was asked for, build it as transformers would by default.
                if "attn_implementation" in raw or "attention implementation" not in str(exc):
                    raise
                return AutoModelForCausalLM.from_config(make_config())

    def batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
        input_ids = torch.randint(0, vocab_size, (batch_size, seq_len))
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    return ModelSource(
        name=str(raw.get("name", path.stem)),
        source=spec,
        default_seq_len=int(raw["seq_len"]) if raw.get("seq_len") else None,
        vocab_size=vocab_size,
        max_seq_len=int(max_seq_len) if max_seq_len else None,
        _build=build,
        _batch=batch,
        _builder_name=f"{architecture} from_config",
    )


@contextlib.contextmanager
def quiet_transformers():
    """Silences transformers' chatter (token ids, loss type) while a model is built or run."""
    if "transformers" not in sys.modules:
        yield
        return
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
