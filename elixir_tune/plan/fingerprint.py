"""The model fingerprint a plan carries, so that a plan is never run on another model.

Computed from parameter names, shapes and dtypes in ``model.named_parameters()`` order (tied
parameters once, frozen ones included) by the profiler when it writes a profile, and again by the
engine at setup. Torch-free: callers pass plain names, shapes and dtype strings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any


def fingerprint(params: Iterable[tuple[str, Sequence[int], str]]) -> str:
    """Hashes a model's parameter list.

    Args:
        params: (name, shape, dtype) for each parameter in named_parameters() order; dtype as
            torch prints it without the "torch." prefix (e.g. "float32").

    Returns:
        16 hex digits.
    """
    digest = hashlib.sha256()
    for name, shape, dtype in params:
        digest.update(f"{name}:{','.join(str(int(s)) for s in shape)}:{dtype};".encode())
    return digest.hexdigest()[:16]


def model_fingerprint(model: Any) -> str:
    """The fingerprint of a module (anything with ``named_parameters()``), live or on the meta device.

    The one recipe the profiler and the engine share: parameter names, shapes and dtypes in
    ``named_parameters()`` order, dtypes as torch prints them without "torch.".
    """
    return fingerprint(
        (name, list(param.shape), str(param.dtype).removeprefix("torch.")) for name, param in model.named_parameters()
    )
