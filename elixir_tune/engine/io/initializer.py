"""The model's own initializer, run unit by unit on the CPU: deterministic whatever the world size.

The module tree is cut into units of at most ``UNIT_NUMEL`` elements (a whole subtree when it is
small enough, else the module's own tensors and then each child), which depends on the model only.
Each unit is initialized on the CPU with its own seed (a hash of the seed and the unit's name):
its tensors are swapped for real ones, the modules' ``reset_parameters()`` run (what their
constructors do), then for a transformers model ``PreTrainedModel._init_weights`` on the unit's
modules and on their ancestors (GPT-2 rescales ``c_proj`` from the parent module), tensors outside
the unit stay on meta, where the initializers do nothing. Tensors are pre-filled with NaN: one the
initializers never wrote is an error. ``materialize.py``'s sources ask it for values.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

UNIT_NUMEL = 1 << 26  # elements initialized at once (256 MiB in fp32): bounds host memory, not values
_KEEP_UNITS = 2  # a unit straddling two chunks is initialized once


class MaterializeError(ValueError):
    """The model's weights cannot be produced (no initializer for a meta tensor, unusable weights)."""


def tensor_registrations(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, bool]]]:
    """id(tensor) -> every (module, attribute, is_parameter) it is registered under (tied weights: several)."""
    found: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                found.setdefault(id(param), []).append((module, name, True))
        for name, buffer in module._buffers.items():
            if buffer is not None:
                found.setdefault(id(buffer), []).append((module, name, False))
    return found


def _hf_init_functions(model: nn.Module) -> dict[nn.Module, Callable[[nn.Module], None]]:
    """Each module's transformers initializer: the ``_init_weights`` of its nearest enclosing PreTrainedModel."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return {}
    functions: dict[nn.Module, Callable[[nn.Module], None]] = {}

    def walk(module: nn.Module, current: Callable[[nn.Module], None] | None) -> None:
        if isinstance(module, PreTrainedModel):
            current = module._init_weights
        if current is not None:
            functions[module] = current
        for child in module.children():
            walk(child, current)

    walk(model, None)
    return functions


def _unit_seed(seed: int, unit_name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{unit_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _unset(tensor: torch.Tensor) -> bool:
    """Still holds the fill value it was created with (NaN, or the dtype's minimum for integers)."""
    if tensor.numel() == 0:
        return False
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    if tensor.dtype == torch.bool:
        return False
    return bool((tensor == torch.iinfo(tensor.dtype).min).all())


def _filled(like: torch.Tensor) -> torch.Tensor:
    if like.is_floating_point() or like.is_complex():
        return torch.full(like.shape, float("nan"), dtype=like.dtype)
    if like.dtype == torch.bool:
        return torch.zeros(like.shape, dtype=like.dtype)
    return torch.full(like.shape, torch.iinfo(like.dtype).min, dtype=like.dtype)


class Initializer:
    """Runs the model's own initializer unit by unit, on the CPU, seeded per unit.

    Args:
        model: the model (meta tensors are initialized; real ones are read as they are).
        seed: the seed every rank agrees on.
        unit_numel: the most elements one unit holds (a whole subtree when it fits); default UNIT_NUMEL.
        provided: ids of tensors that come from elsewhere (a checkpoint): they need no initializer.

    Raises:
        MaterializeError: a meta tensor that no module around it knows how to initialize.
    """

    def __init__(self, model: nn.Module, seed: int, unit_numel: int | None = None, provided: set[int] | None = None):
        self.model = model
        self.seed = int(seed)
        self.unit_numel = unit_numel or UNIT_NUMEL
        self.registrations = tensor_registrations(model)
        self.hf_init = _hf_init_functions(model)
        self.parent: dict[nn.Module, nn.Module] = {}
        for module in model.modules():
            for child in module.children():
                self.parent.setdefault(child, module)
        # Canonical owner of each tensor: the module of its first name (named_parameters order).
        # Shapes and dtypes as built (``tensors``: meta stand-ins): the engine later swaps the
        # chunked parameters for real placeholders, and those must still read as "to initialize".
        self.owner: dict[int, nn.Module] = {}
        self.tensors: dict[int, torch.Tensor] = {}
        self.names: dict[int, str] = {}
        self.meta: set[int] = set()
        named_modules = dict(model.named_modules())
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            self.owner[id(tensor)] = named_modules[name.rpartition(".")[0]]
            self.tensors[id(tensor)] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            self.names[id(tensor)] = name
            if tensor.is_meta:
                self.meta.add(id(tensor))
        own: dict[nn.Module, list[int]] = {}
        for key, module in self.owner.items():
            own.setdefault(module, []).append(key)
        self.units: list[tuple[str, nn.Module, list[int], bool]] = []  # name, root, tensor ids, whole subtree
        self.unit_of: dict[int, int] = {}
        self._cut(model, "", own)
        self._cache: OrderedDict[int, dict[int, torch.Tensor]] = OrderedDict()
        self._check_initializable(provided or set())

    def _cut(self, module: nn.Module, name: str, own: dict[nn.Module, list[int]]) -> list[int]:
        """Splits ``module``'s subtree into units; returns the tensor ids of the subtree."""
        subtree = list(own.get(module, []))
        children = [
            (f"{name}.{child_name}" if name else child_name, child) for child_name, child in module.named_children()
        ]
        below = {child: self._collect(child, own) for _, child in children}
        total = sum(self.tensors[k].numel() for k in subtree) + sum(
            self.tensors[k].numel() for ids in below.values() for k in ids
        )
        if total <= self.unit_numel or not children:
            ids = subtree + [k for ids in below.values() for k in ids]
            self._add_unit(name or "<root>", module, ids, whole=True)
            return ids
        if subtree:
            self._add_unit((name or "<root>") + ":own", module, subtree, whole=False)
        for child_name, child in children:
            subtree += self._cut(child, child_name, own)
        return subtree

    def _collect(self, module: nn.Module, own: dict[nn.Module, list[int]]) -> list[int]:
        return [k for m in module.modules() for k in own.get(m, [])]

    def _add_unit(self, name: str, root: nn.Module, ids: list[int], whole: bool) -> None:
        ids = [k for k in dict.fromkeys(ids) if k not in self.unit_of]  # a module reached twice counts once
        if not ids:
            return
        for key in ids:
            self.unit_of[key] = len(self.units)
        self.units.append((name, root, ids, whole))

    def _unit_modules(self, unit: int) -> tuple[list[nn.Module], list[nn.Module]]:
        """A unit's modules, children before parents (as ``Module.apply``), and its ancestors that
        have a transformers initializer (innermost first)."""
        _, root, _, whole = self.units[unit]
        modules = [root]
        if whole:
            modules = []

            def post_order(module: nn.Module) -> None:
                for child in module.children():
                    post_order(child)
                modules.append(module)

            post_order(root)
        ancestors = []
        node = self.parent.get(root)
        while node is not None:
            if node in self.hf_init:
                ancestors.append(node)
            node = self.parent.get(node)
        return list(dict.fromkeys(modules)), ancestors

    def _check_initializable(self, provided: set[int]) -> None:
        """Every meta tensor's module, or one around it, must have an initializer (a cheap check up front;
        what an initializer leaves unset is caught when its unit runs)."""

        def covered(module: nn.Module | None) -> bool:
            while module is not None:
                if module in self.hf_init or callable(getattr(module, "reset_parameters", None)):
                    return True
                module = self.parent.get(module)
            return False

        problems: dict[str, list[str]] = {}
        for key in self.meta - provided:
            owner = self.owner[key]
            if not covered(owner):
                problems.setdefault(type(owner).__name__, []).append(self.names[key])
        if problems:
            listed = [f"{', '.join(names[:4])} ({kind})" for kind, names in problems.items()]
            raise MaterializeError(
                "the model has tensors on the meta device that nothing can initialize: "
                + "; ".join(listed[:8])
                + ". Their modules have no reset_parameters() (and the model is no transformers PreTrainedModel): "
                "give them one, build the model with real weights, or pass weights=PATH (a safetensors checkpoint) "
                "to setup"
            )

    def value(self, tensor: torch.Tensor) -> torch.Tensor:
        """The initial value of one of the model's tensors (CPU, its own dtype); real tensors as they are."""
        if id(tensor) not in self.meta:
            return tensor.detach()
        return self._unit_values(self.unit_of[id(tensor)])[id(tensor)]

    @torch.no_grad()
    def _unit_values(self, unit: int) -> dict[int, torch.Tensor]:
        if unit in self._cache:
            self._cache.move_to_end(unit)
            return self._cache[unit]
        name, root, ids, _ = self.units[unit]
        meta = [k for k in ids if k in self.meta]
        temps = {k: _filled(self.tensors[k]) for k in meta}
        swapped = []
        for key in meta:
            for module, attr, is_param in self.registrations[key]:
                # Parameters or buffers: one code path for both registration tables.
                table: dict[str, Any] = module._parameters if is_param else module._buffers
                original = table[attr]
                value = temps[key]
                table[attr] = nn.Parameter(value, requires_grad=original.requires_grad) if is_param else value
                swapped.append((table, attr, original))
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_unit_seed(self.seed, name))
                modules, ancestors = self._unit_modules(unit)
                for module in modules:  # what the constructors do
                    reset = getattr(module, "reset_parameters", None)
                    if callable(reset):
                        reset()
                for module in modules + ancestors:  # then transformers' post_init
                    init = self.hf_init.get(module)
                    if init is not None:
                        init(module)
        finally:
            for table, attr, original in reversed(swapped):
                table[attr] = original
        unset = [self.names[k] for k in meta if _unset(temps[k])]
        if unset:
            raise MaterializeError(
                f"the model's initializer left {len(unset)} tensor(s) of {name} unset (they were built on the meta "
                f"device): {', '.join(unset[:8])}. Give their module a reset_parameters() method (or, for a "
                "transformers model, cover them in _init_weights), or pass weights=PATH to setup"
            )
        self._cache[unit] = temps
        while len(self._cache) > _KEEP_UNITS:
            self._cache.popitem(last=False)
        return temps
