"""Hardware presets (configs/hardware/<id>.yaml), loading by id or file, and sanity checks.

No torch here: a search on a laptop loads presets without it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path

from elixir_tune import paths
from elixir_tune.files import problem
from elixir_tune.hardware.spec import HardwareSpec, load_hardware_file

DEVICES = ("cuda", "cpu")
POSITIVE_RATES = (  # the spec's flat rates (higher is faster), each checked positive
    "hbm_gbps",
    "h2d_gbps",
    "d2h_gbps",
    "h2d_gbps_all",
    "d2h_gbps_all",
    "allgather_gbps",
    "reduce_scatter_gbps",
    "inter_node_gbps",
    "gpu_adam_elems_per_s",
    "cpu_adam_elems_per_s",
)


def list_presets() -> list[str]:
    """Ids of the hardware presets shipped in configs/hardware/, sorted."""
    return sorted(path.stem for path in paths.HARDWARE_CONFIGS_DIR.glob("*.yaml"))


def preset_path(preset_id: str) -> Path:
    """The file of a preset id (it may not exist)."""
    return paths.HARDWARE_CONFIGS_DIR / f"{preset_id}.yaml"


def _looks_like_path(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) or os.sep in name or "/" in name


def load_hardware(name_or_path: str) -> HardwareSpec:
    """Loads a preset by id (``a100-40gb-pcie``) or a spec file (a probe result).

    A bare id that names a preset wins over a file of the same name in the working directory;
    anything that looks like a path (has a ``/`` or ends in .yaml) is read as a file.

    Args:
        name_or_path: a preset id or a YAML file path.

    Returns:
        The spec, checked with ``spec_problems``.

    Raises:
        FileNotFoundError: a path that does not exist (the message lists the preset ids).
        ValueError: neither a preset id nor a file, or the spec is not valid.
    """
    name = str(name_or_path)
    presets = list_presets()
    listed = ", ".join(presets) or f"(none found in {paths.HARDWARE_CONFIGS_DIR})"
    known = f"known presets: {listed}"
    if name in presets and not _looks_like_path(name):
        path = preset_path(name)
    elif Path(name).is_file():
        path = Path(name)
    elif _looks_like_path(name):
        raise FileNotFoundError(
            f"{name}: no such hardware file; {known}, or write one with `elixir-tune probe --out {name}`"
        )
    else:
        raise ValueError(f"unknown hardware {name!r}: not a preset id nor a file; {known}")
    spec = load_hardware_file(path)
    problems = spec_problems(spec)
    if problems:
        raise problem(path, problems, "hardware spec", "fix the field or write it again with `elixir-tune probe`")
    return spec


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


Rule = Callable[[str, object], "str | None"]  # (field, value) -> the problem, or None


def _integer(minimum: int) -> Rule:
    def check(name: str, value: object) -> str | None:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name}: expected an integer, got {value!r}"
        return f"{name}: must be positive, got {value}" if value < minimum else None

    return check


def _number(holds: Callable[[float], bool], expected: str) -> Rule:
    def check(name: str, value: object) -> str | None:
        good = _is_number(value) and holds(value)  # type: ignore[arg-type]
        return None if good else f"{name}: expected {expected}, got {value!r}"

    return check


def _boolean(name: str, value: object) -> str | None:
    return None if isinstance(value, bool) else f"{name}: expected true or false, got {value!r}"


_POSITIVE = _number(lambda v: v > 0, "a positive number")
# Each scalar field's rule. Types first: a YAML ``1e9`` without a dot reads as a string.
_FIELD_RULES: dict[str, Rule] = {
    **dict.fromkeys(
        ("gpus_per_node", "gpu_memory_bytes", "usable_memory_bytes", "host_memory_bytes", "host_cores"), _integer(1)
    ),
    "allocator_overhead_bytes": _integer(0),
    **dict.fromkeys(POSITIVE_RATES, _POSITIVE),
    **dict.fromkeys(
        (
            "copy_latency_s",
            "collective_latency_s",
            "block_call_overhead_s",
            "tensor2_block_fixed_s",
            "pipeline_stage_microbatch_s",
            "dropout_attention_s_per_score",
        ),
        _number(lambda v: 0 <= v < 1, "seconds in [0, 1)"),
    ),
    **dict.fromkeys(
        ("tensor2_block_extra_ratio", "pipeline_microbatch_extra_ratio"),
        _number(lambda v: 0 <= v < 100, "a ratio in [0, 100) (0: not measured)"),
    ),
    "cpu_adam_node_elems_per_s": _number(lambda v: v >= 0, "a number >= 0 (0: derived)"),
    **dict.fromkeys(("shared_host_link", "rate_fused_attention"), _boolean),
    **dict.fromkeys(
        ("pointwise_gbps", "rate_pointwise_elems"), _number(lambda v: v >= 0, "a number >= 0 (0: not known)")
    ),
    "collective_compute_loss": _number(lambda v: 0 <= v < 10, "seconds per second in [0, 10) (0: none)"),
    "recompute_speedup": _number(lambda v: 0.5 <= v <= 4, "a speed-up in [0.5, 4] (1: the mean rate)"),
}
# Mappings of numbers (per dtype, or the probe's load record; optional, empty by default): each value's rule.
_PER_DTYPE_RULES: dict[str, Rule] = {
    "matmul_peak_tflops": _POSITIVE,
    "model_tflops": _POSITIVE,
    "attention_tflops": _POSITIVE,
    "best_mfu": _number(lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    "probe_load": _number(lambda v: v >= 0, "a number >= 0"),
}


# The fields that hold mappings (an edit may put a number or nothing there).
_MAPPINGS = (*_PER_DTYPE_RULES, "matmul_tflops", "sources", "block_tflops_curves", "bandwidth_curves")


def spec_problems(spec: HardwareSpec) -> list[str]:
    """Every way ``spec`` is not a usable description of a node (empty list when it is).

    Checks types, signs and ranges field by field (``_FIELD_RULES``, ``_PER_DTYPE_RULES``) and the
    relations between fields (usable <= total memory, curves); magnitudes are the tests' business,
    not the loader's.
    """
    problems: list[str | None] = [
        None if spec.device in DEVICES else f"device: {spec.device!r} is not one of {', '.join(DEVICES)}"
    ]
    for name, rule in _FIELD_RULES.items():
        problems.append(rule(name, getattr(spec, name)))
    not_mappings = [name for name in _MAPPINGS if not isinstance(getattr(spec, name), dict)]
    if not_mappings:  # the rules below read them as mappings
        return [found for found in problems if found] + [
            f"{name}: expected a mapping, got {getattr(spec, name)!r}" for name in not_mappings
        ]
    for name, rule in _PER_DTYPE_RULES.items():
        problems += [rule(f"{name}.{dtype}", value) for dtype, value in getattr(spec, name).items()]
    if (
        isinstance(spec.usable_memory_bytes, int)
        and isinstance(spec.gpu_memory_bytes, int)
        and spec.usable_memory_bytes > spec.gpu_memory_bytes
    ):
        problems.append("usable_memory_bytes: larger than gpu_memory_bytes")
    problems += [*_matmul_problems(spec), *_mapping_problems(spec)]
    return [found for found in problems if found]


def _matmul_problems(spec: HardwareSpec) -> list[str]:
    if not isinstance(spec.matmul_tflops, dict) or "fp32" not in spec.matmul_tflops:
        return ["matmul_tflops: expected a mapping with at least fp32"]
    return [p for dtype, value in spec.matmul_tflops.items() if (p := _POSITIVE(f"matmul_tflops.{dtype}", value))]


def _mapping_problems(spec: HardwareSpec) -> list[str]:
    """The sources and the curves: keys that must be hardware fields, values of the right kind."""
    problems = []
    fields = {f.name for f in dataclasses.fields(HardwareSpec)}
    if not isinstance(spec.sources, dict):
        problems.append("sources: expected a mapping of field name -> source")
    else:
        problems += [f"sources.{key}: not a hardware field" for key in spec.sources if key not in fields]
    for dtype, curve in spec.block_tflops_curves.items():
        if (
            not isinstance(curve, dict)
            or not curve
            or not all(_is_number(f) and f > 0 and _is_number(t) and t > 0 for f, t in curve.items())
        ):
            problems.append(f"block_tflops_curves.{dtype}: expected {{block parameters: positive TFLOP/s}}")
    for curve_name, curve in spec.bandwidth_curves.items():
        if curve_name not in fields:
            problems.append(f"bandwidth_curves.{curve_name}: not a hardware field")
        elif not isinstance(curve, dict) or not all(
            isinstance(size, int) and _is_number(gbps) and gbps > 0 for size, gbps in curve.items()
        ):
            problems.append(f"bandwidth_curves.{curve_name}: expected {{bytes: positive GB/s}}")
    return problems


def closest_preset(spec: HardwareSpec) -> str | None:
    """The preset of the same device kind most like ``spec`` (None when there is none).

    Distance: sum of |log ratio| over memory, the best matmul rate, HBM and host-link bandwidth.
    """

    def key_numbers(candidate: HardwareSpec) -> list[float]:
        return [
            candidate.gpu_memory_bytes,
            max(candidate.matmul_tflops.values()),
            candidate.hbm_gbps,
            candidate.h2d_gbps,
        ]

    mine = key_numbers(spec)
    best, best_distance = None, math.inf
    for preset_id in list_presets():
        try:
            preset = load_hardware(preset_id)
        except (ValueError, FileNotFoundError):
            continue
        if preset.device != spec.device:
            continue
        distance = sum(abs(math.log(a / b)) for a, b in zip(mine, key_numbers(preset), strict=True))
        if distance < best_distance:
            best, best_distance = preset_id, distance
    return best


# What a probe cannot measure on one machine, borrowed from the closest preset (each fitted to published runs).
BORROWED_FIELDS = ("recompute_speedup", "collective_compute_loss")


def with_borrowed_constants(spec: HardwareSpec) -> HardwareSpec:
    """``spec`` (a probed GPU) with the closest preset's ``BORROWED_FIELDS`` where it left them at their
    defaults, each source saying so; a CPU or a spec with no preset of its kind is returned as it is.
    The collectives' cost to compute is borrowed only beside NVLink (``shared_host_link`` False): the
    presets' value comes from NVLink runs."""
    preset_id = closest_preset(spec) if spec.device == "cuda" else None
    if preset_id is None:
        return spec
    preset = load_hardware(preset_id)
    speedup = spec.recompute_speedup if spec.recompute_speedup != 1.0 else preset.recompute_speedup
    nvlink = not spec.shared_host_link and spec.gpus_per_node > 1
    loss = (
        preset.collective_compute_loss
        if spec.collective_compute_loss == 0.0 and nvlink
        else spec.collective_compute_loss
    )
    borrowed = [
        name
        for name, value in (("recompute_speedup", speedup), ("collective_compute_loss", loss))
        if value != getattr(spec, name)
    ]
    if not borrowed:
        return spec
    sources = dict(spec.sources)
    for name in borrowed:
        sources[name] = f"assumption, the closest preset's ({preset_id}): the probe does not measure it"
    return dataclasses.replace(spec, recompute_speedup=speedup, collective_compute_loss=loss, sources=sources)
