"""Safetensors weights in: find the files, match their names to the model's, read slices.

``WeightsReader`` takes what users download: one ``.safetensors`` file, a sharded checkpoint's
``model.safetensors.index.json``, or a Hugging Face model directory holding either. It reads only
the headers up front (names, shapes, dtypes) and checks them against the model before anything is
loaded: every missing, unexpected or wrongly shaped tensor is listed in one error. Afterwards each
rank reads only the element ranges of its own shards (``safe_open(...).get_slice``, memory-mapped),
converted to fp32.

Names follow Hugging Face's conventions: a file saved from the base model (``GPT2Model``, no
``transformer.`` prefix) loads into the LM model and the reverse; a tied weight (``lm_head.weight``
of GPT-2) is one tensor with several names, and any of them in the file sets it; the model class's
``_keys_to_ignore_on_load_unexpected`` / ``_keys_to_ignore_on_load_missing`` patterns are honoured.
A LoRA model (PEFT) reads the base checkpoint: its base parameters' names are mapped back
(``elixir_tune.models.lora_layout.base_name``) and its adapter parameters, in no base checkpoint, are not missing
(they start as PEFT starts them, ``elixir_tune.models.lora.adapter_init``).
A mixture-of-experts model's fused expert tensors are read from the one-tensor-per-expert files
transformers writes and the Hub holds (``stacked.py``: transformers' own conversion rules).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from elixir_tune.engine.io.stacked import Stacked, find_stacked, stack_rules
from elixir_tune.models.lora_layout import base_name, is_adapter_name

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_LISTED = 8  # names quoted per kind of problem


class WeightsError(ValueError):
    """The weights cannot be used for this model; the message lists every problem found."""


def _safe_open(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError for I/O)
        raise WeightsError(
            f"{path} is not a readable safetensors file (truncated or corrupt: {exc}); download or save it again"
        ) from exc


def find_weight_files(path: str | Path) -> dict[str, Path]:
    """Which file holds each tensor.

    Args:
        path: a ``.safetensors`` file, a ``model.safetensors.index.json``, or a directory holding
            one of them (or several ``*.safetensors`` files without an index).

    Returns:
        tensor name -> file.

    Raises:
        WeightsError: nothing to read there, a broken index, or an unreadable file.
    """
    path = Path(path)
    if not path.exists():
        raise WeightsError(f"weights {path}: no such file or directory")
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            return find_weight_files(path / INDEX_NAME)
        files = [path / WEIGHTS_NAME] if (path / WEIGHTS_NAME).is_file() else sorted(path.glob("*.safetensors"))
        if not files:
            others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".h5"))
            hint = (
                f"; it has {', '.join(others[:4])}: only safetensors are read, convert them with "
                "transformers (`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out)`)"
                if others
                else ""
            )
            raise WeightsError(
                f"weights {path}: the directory has no {WEIGHTS_NAME}, {INDEX_NAME} or *.safetensors{hint}"
            )
        found: dict[str, Path] = {}
        for file in files:
            with _safe_open(file) as handle:
                found.update(dict.fromkeys(handle.keys(), file))
        return found
    if path.name.endswith(".json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise WeightsError(f"weights index {path}: not a safetensors index (no weight_map): {exc}") from exc
        file_of = {name: path.parent / file for name, file in weight_map.items()}
        absent = sorted({str(file) for file in file_of.values() if not file.is_file()})
        if absent:
            raise WeightsError(f"weights index {path} names files that are not there: {', '.join(absent[:_LISTED])}")
        return file_of
    with _safe_open(path) as handle:
        return dict.fromkeys(handle.keys(), path)


def _patterns(model: torch.nn.Module, attribute: str) -> list[re.Pattern]:
    return [re.compile(p) for p in (getattr(type(model), attribute, None) or getattr(model, attribute, None) or [])]


class WeightsReader:
    """The tensors of a safetensors checkpoint, matched to a model's state-dict entries.

    Args:
        path: file, index or directory (see :func:`find_weight_files`).
        model: the model to load into (on the meta device or not; only names and shapes are used).

    Attributes:
        names: id(model tensor) -> the name it has in the files, for every tensor the files hold.

    Raises:
        WeightsError: unreadable files, or missing / unexpected / wrongly shaped tensors (all listed).
    """

    def __init__(self, path: str | Path, model: torch.nn.Module):
        self.path = Path(path)
        self.files = find_weight_files(self.path)
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.files.values())):
            with _safe_open(file) as handle:
                for name in handle.keys():
                    if self.files.get(name) == file:
                        self.shapes[name] = tuple(handle.get_slice(name).get_shape())
        absent = sorted(set(self.files) - set(self.shapes))
        if absent:
            raise WeightsError(
                f"weights {self.path}: the index lists tensors its files lack: {', '.join(absent[:_LISTED])}"
            )
        self._handles: dict[Path, Any] = {}  # what safe_open.__enter__ returns (untyped in safetensors)
        # Fused expert tensors the files hold one per expert, by the model name they are read under.
        self.stacked: dict[str, Stacked] = {}
        self.names = self._match(model)

    def _match(self, model: torch.nn.Module) -> dict[int, str]:
        prefix = getattr(model, "base_model_prefix", "") or ""
        by_tensor: dict[int, list[str]] = {}
        tensors: dict[int, torch.Tensor] = {}
        params = {id(p) for p in model.parameters()}
        for name, value in model.state_dict(keep_vars=True).items():
            by_tensor.setdefault(id(value), []).append(name)
            tensors[id(value)] = value

        rules = stack_rules(model)

        def candidates(name: str) -> list[str]:
            out = []
            for plain in dict.fromkeys([name, base_name(name)]):  # a LoRA model's base parameter
                out.append(plain)
                if prefix and plain.startswith(prefix + "."):
                    out.append(plain[len(prefix) + 1 :])  # saved from the base model
                elif prefix:
                    out.append(f"{prefix}.{plain}")  # saved from a model wrapping this base model
            # The checkpoint's older spellings that transformers renames on load (Mixtral's block_sparse_moe).
            renamed = [n.replace(new, old) for n in out for old, new in rules.renamings if new in n]
            return list(dict.fromkeys(out + renamed))

        names: dict[int, str] = {}
        missing, shape_errors = [], []
        for key, aliases in by_tensor.items():
            found = next((c for alias in aliases for c in candidates(alias) if c in self.shapes), None)
            if found is None and rules.converters:  # fused experts the files hold one per expert
                expected = tuple(tensors[key].shape)
                for candidate in (c for alias in aliases for c in candidates(alias)):
                    stacked = find_stacked(candidate, expected, self.shapes, rules)
                    if stacked is not None:
                        self.stacked[candidate] = stacked
                        names[key] = candidate
                        break
                if key in names:
                    continue
            if found is None:
                if key in params and not is_adapter_name(aliases[0]):
                    # A buffer the file lacks keeps (or recomputes) its value, as in transformers; a LoRA
                    # adapter starts as PEFT starts it.
                    missing.append(aliases[0])
                continue
            names[key] = found
            expected = tuple(tensors[key].shape)
            if self.shapes[found] != expected:
                shape_errors.append(f"{found} (file {list(self.shapes[found])}, model {list(expected)})")
        ignore_missing = _patterns(model, "_keys_to_ignore_on_load_missing")
        missing = [n for n in missing if not any(p.search(n) for p in ignore_missing)]
        used = set(names.values()) | {part for stacked in self.stacked.values() for part in stacked.file_names()}
        ignore_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected")
        unexpected = [n for n in self.shapes if n not in used and not any(p.search(n) for p in ignore_unexpected)]
        problems = []
        for label, items in (
            ("missing", missing),
            ("unexpected", sorted(unexpected)),
            ("wrongly shaped", shape_errors),
        ):
            if items:
                more = f" (and {len(items) - _LISTED} more)" if len(items) > _LISTED else ""
                problems.append(f"{len(items)} {label}: {', '.join(items[:_LISTED])}{more}")
        if problems:
            raise WeightsError(
                f"weights {self.path} do not match the model {type(model).__name__}: " + "; ".join(problems) + ". "
                "Check that they were saved from this architecture and config (the model directory's config.json)"
            )
        return names

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = _safe_open(file).__enter__()
        return self._handles[file]

    def release(self) -> None:
        """Closes the open files (unmaps them: pages read so far leave this process's resident set)."""
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def _read(self, fn, name: str) -> torch.Tensor:
        try:
            return fn()
        except WeightsError:
            raise
        except Exception as exc:
            raise WeightsError(
                f"weights {self.files.get(name, self.path)}: reading {name} failed (truncated or corrupt file?): {exc}"
            ) from exc

    def read_range(self, name: str, begin: int, end: int) -> torch.Tensor:
        """Elements ``[begin, end)`` of tensor ``name`` (flattened), as fp32.

        Reads the rows covering the range only: at most two partial rows more than asked.
        """
        if name in self.stacked:
            return self._read(lambda: self.stacked[name].read_range(self.read_full, begin, end), name)
        shape = self.shapes[name]
        if len(shape) == 0:
            return self.read_full(name).reshape(-1)[begin:end].float()
        row = math.prod(shape[1:])
        first, last = begin // row, -(-end // row)

        def read() -> torch.Tensor:
            return self._handle(name).get_slice(name)[first:last]

        rows = self._read(read, name)
        return rows.reshape(-1)[begin - first * row : end - first * row].float()

    def read_full(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``, in its stored dtype."""
        if name in self.stacked:
            stacked = self.stacked[name]
            return stacked.experts(self.read_full, 0, stacked.shape[0])
        return self._read(lambda: self._handle(name).get_tensor(name), name)

    def read_piece(self, name: str, runs: list[list[tuple[int, int]]]) -> torch.Tensor:
        """A tensor-parallel rank's piece of tensor ``name``, as fp32: the full tensor indexed by the
        product of ``runs`` (per dimension, ``[begin, end)`` ranges in the piece's order; see
        ``Layout.local_runs``). Each block is read with ``get_slice``: nothing outside the piece (of a
        fused expert tensor stored per expert: nothing outside the piece's experts)."""
        if name in self.stacked:
            return self._read(lambda: self.stacked[name].read_piece(self.read_full, runs), name)
        shape = self.shapes[name]
        if len(runs) != len(shape):
            raise ValueError(f"{name}: {len(runs)} dimensions of runs for a tensor of shape {list(shape)}")
        piece = torch.empty([sum(end - begin for begin, end in dim_runs) for dim_runs in runs], dtype=torch.float32)
        starts = [list(itertools.accumulate([0] + [end - begin for begin, end in dim_runs])) for dim_runs in runs]
        for block in itertools.product(*[range(len(dim_runs)) for dim_runs in runs]):
            source = tuple(slice(*runs[axis][i]) for axis, i in enumerate(block))
            target = tuple(slice(starts[axis][i], starts[axis][i + 1]) for axis, i in enumerate(block))

            def read(source=source) -> torch.Tensor:
                return self._handle(name).get_slice(name)[source]

            piece[target] = self._read(read, name).float()
        return piece
