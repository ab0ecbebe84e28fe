"""Hardware: the HardwareSpec contract, presets in configs/hardware/, and the local probe.

Importing this package does not import torch; `probe` imports it when called.

    from elixir_tune.hardware import load_hardware, probe
    spec = load_hardware("a100-40gb-pcie")     # a preset id, or a probe result file
    spec = probe(quick=True)                   # measure this machine
"""

from __future__ import annotations

from collections.abc import Callable

from elixir_tune.hardware.presets import (
    closest_preset,
    list_presets,
    load_hardware,
    preset_path,
    spec_problems,
    with_borrowed_constants,
)
from elixir_tune.hardware.spec import HardwareSpec, load_hardware_file, save_hardware


def probe(
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
    procs: int | None = None,
    device: str | None = None,
) -> HardwareSpec:
    """Measures this machine; see elixir_tune.hardware.probe_local.probe.

    Args:
        quick: fewer sizes and repeats (under ~30 s on a 2-core CPU machine).
        progress: called with a short description as each measurement starts.
        procs: worker processes when the CPU is the device (default 2); ignored with GPUs.
        device: "cuda" or "cpu" to force one; default cuda when available.

    Returns:
        The measured spec (``sources`` says how each number was obtained).
    """
    from elixir_tune.hardware.probe_local import probe as run_probe

    return run_probe(quick=quick, progress=progress, procs=procs, device=device)


__all__ = [
    "HardwareSpec",
    "closest_preset",
    "with_borrowed_constants",
    "list_presets",
    "load_hardware",
    "load_hardware_file",
    "preset_path",
    "probe",
    "save_hardware",
    "spec_problems",
]
