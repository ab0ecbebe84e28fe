"""Formatting of byte counts for messages and tables, shared by every package. Imports no torch."""

from __future__ import annotations

GIB = 2**30


def gib(num_bytes: float, decimals: int = 2) -> str:
    """Bytes as GiB with a fixed number of decimals (``12.50 GiB``), for messages that compare sizes."""
    return f"{num_bytes / GIB:.{decimals}f} GiB"


def human_bytes(num_bytes: float) -> str:
    """Bytes with the binary unit that keeps 3 significant digits readable (12.3 MiB, 1.50 GiB)."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes:.0f} B"
