"""Validation and construction derived from typed dataclasses.

The schema's dataclasses are the single source of truth: a field's Python type says what a YAML
value must be, ``Literal[...]`` lists the allowed choices, ``Annotated[int, Min(1)]`` bounds a
number, a default makes the field optional, and a nested dataclass (or a list of them) is a nested
mapping. This module reads those annotations with ``typing.get_type_hints`` and turns a plain
mapping (parsed YAML) into the list of every problem, each with its field path, and a checked
mapping back into dataclasses.

Why stdlib dataclasses and typing rather than pydantic: the plan package must import without torch
and with as few dependencies as possible (it is read by the launcher before any worker starts),
the messages must stay exactly as users and tests know them (pydantic's are its own and stop
listing per field once a model fails to build), and the whole mechanism is this one module.

Messages (``path`` is the dotted field path, list items as ``[i]``):
    ``path: missing (expected <what>)``, ``path: expected <what>, got <value>``,
    ``path: must be positive, got <v>``, ``path: must not be negative, got <v>``,
    ``path: unknown value <v> (expected one of a, b)``, ``path: unknown field (known: ...)``,
    ``path.key: unknown key (known: ...)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Annotated, Any, Literal, Union, get_args, get_origin


@dataclasses.dataclass(frozen=True)
class Min:
    """Lower bound of a number field, used as ``Annotated[int, Min(0)]``.

    Attributes:
        value: the smallest allowed value.
        expected: when set, the description used in every message of the field instead of the
            type's (e.g. "0 (none), 1 (all) or k > 1"): ``path: expected <expected>, got <v>``.
    """

    value: float
    expected: str = ""


PositiveInt = Annotated[int, Min(1)]
NonNegativeInt = Annotated[int, Min(0)]
NonNegativeFloat = Annotated[float, Min(0)]

# Every count and size ends in a torch tensor's shape or a byte count: int64.
INT64_LIMIT = 2**63

_TYPE_NAMES = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass, ``Annotated`` extras kept."""
    return typing.get_type_hints(cls, include_extras=True)


def _unwrap(hint: Any) -> tuple[Any, Min | None]:
    """(the bare type, its bound): strips ``Annotated`` and ``X | None``."""
    bound = None
    if get_origin(hint) is Annotated:
        hint, *extras = get_args(hint)
        bound = next((extra for extra in extras if isinstance(extra, Min)), None)
    if get_origin(hint) in (Union, types.UnionType):
        options = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(options) == 1:
            return _unwrap(options[0])[0], bound
    return hint, bound


def is_required(field: dataclasses.Field) -> bool:
    """A field without a default must be present."""
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def section_type(cls: type, name: str) -> Any:
    """The bare type of field ``name`` of ``cls`` (``X | None`` and ``Annotated`` stripped)."""
    return _unwrap(type_hints(cls)[name])[0]


def choices(hint: Any) -> tuple[Any, ...]:
    """The values a ``Literal`` type allows."""
    return get_args(hint)


def describe(hint: Any) -> str:
    """What a value of this type is, for messages (``an integer``, ``one of cuda, cpu``, ...)."""
    bare, bound = _unwrap(hint)
    if bound is not None and bound.expected:
        return bound.expected
    origin = get_origin(bare)
    if origin is Literal:
        return "one of " + ", ".join(str(choice) for choice in get_args(bare))
    if origin is list:
        return "a list"
    if origin is dict or dataclasses.is_dataclass(bare):
        return "a mapping"
    return _TYPE_NAMES.get(bare, "a value")


def _matches(value: Any, bare: Any) -> bool:
    if bare is Any:
        return True
    if isinstance(value, bool):
        return bare is bool
    if bare is float:  # nan and inf would flow into every prediction made from the file
        return isinstance(value, (int, float)) and math.isfinite(value)
    if get_origin(bare) is Literal:
        return isinstance(value, type(get_args(bare)[0]))
    if dataclasses.is_dataclass(bare):
        return isinstance(value, dict)
    return isinstance(value, get_origin(bare) or bare)


_BAD = object()


def check_value(value: Any, hint: Any, path: str, errors: list[str]) -> Any:
    """Checks one value against a type, appending every problem.

    Args:
        value: the parsed YAML value (not None).
        hint: the field's annotation.
        path: its field path, for messages.
        errors: where problems go.

    Returns:
        The value when it is well typed (a nested dataclass: its well-typed fields as a mapping; a
        list: its items with None for the bad ones), else a private sentinel.
    """
    bare, bound = _unwrap(hint)
    if not _matches(value, bare):
        errors.append(f"{path}: expected {describe(hint)}, got {value!r}")
        return _BAD
    if bare is int and not -INT64_LIMIT < value < INT64_LIMIT:
        errors.append(f"{path}: {value} is beyond a 64-bit integer, the largest size torch takes")
        return _BAD
    origin = get_origin(bare)
    if origin is Literal and value not in get_args(bare):
        errors.append(f"{path}: unknown value {value!r} (expected {describe(hint)})")
        return _BAD
    if bound is not None and value < bound.value:
        if bound.expected:
            errors.append(f"{path}: expected {bound.expected}, got {value!r}")
        elif bound.value == 1 and bare is int:
            errors.append(f"{path}: must be positive, got {value}")
        elif bound.value == 0:
            errors.append(f"{path}: must not be negative, got {value}")
        else:
            errors.append(f"{path}: must be at least {bound.value}, got {value}")
        return _BAD
    if dataclasses.is_dataclass(bare):
        return check_fields(value, bare, path, errors)  # type: ignore[arg-type]
    if origin is list:
        (item_hint,) = get_args(bare) or (Any,)
        # Bad items stay as None, so that rules over the list still see every item at its index.
        items = [check_value(item, item_hint, f"{path}[{i}]", errors) for i, item in enumerate(value)]
        return [None if item is _BAD else item for item in items]
    if origin is dict:
        key_hint, value_hint = get_args(bare) or (Any, Any)
        good = {}
        for key, item in value.items():
            if get_origin(key_hint) is Literal and key not in get_args(key_hint):
                errors.append(f"{path}.{key}: unknown key (known: {', '.join(get_args(key_hint))})")
                continue
            item = check_value(item, value_hint, f"{path}.{key}", errors)
            if item is not _BAD:
                good[key] = item
        return good
    return value


def check_fields(mapping: dict, cls: type, path: str, errors: list[str]) -> dict[str, Any]:
    """Checks a mapping against a dataclass's fields: presence, types, choices, bounds, unknown names.

    Args:
        mapping: the parsed YAML mapping.
        cls: the dataclass it should build.
        path: the mapping's field path ("" for a top-level document).
        errors: where problems go, in field order, unknown names last.

    Returns:
        The well-typed fields (nested ones as their well-typed part).
    """
    hints = type_hints(cls)
    good: dict[str, Any] = {}
    known = [field.name for field in dataclasses.fields(cls)]
    prefix = f"{path}." if path else ""
    for field in dataclasses.fields(cls):
        field_path = prefix + field.name
        value = mapping.get(field.name)
        if value is None:
            if is_required(field):
                errors.append(f"{field_path}: missing (expected {describe(hints[field.name])})")
            continue
        checked = check_value(value, hints[field.name], field_path, errors)
        if checked is not _BAD:
            good[field.name] = checked
    for name in mapping:
        if name not in known:
            errors.append(f"{prefix}{name}: unknown field (known: {', '.join(known)})")
    return good


def build(cls: type, mapping: dict) -> Any:
    """Builds ``cls`` from a mapping that ``check_fields`` accepted (nested dataclasses included)."""
    hints = type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):
        value = mapping.get(field.name)
        if value is None:
            continue  # the default
        bare, _ = _unwrap(hints[field.name])
        if dataclasses.is_dataclass(bare):
            value = build(bare, value)  # type: ignore[arg-type]
        elif get_origin(bare) is list and get_args(bare) and dataclasses.is_dataclass(get_args(bare)[0]):
            value = [build(get_args(bare)[0], item) for item in value]
        kwargs[field.name] = value
    return cls(**kwargs)
