"""The model fingerprint a plan carries, so that a plan is never run on another model.

Computed from parameter names, shapes and dtypes in ``model.named_parameters()`` order (tied
parameters once, frozen ones included) by the profiler when it writes a profile, and again by the
engine at setup. A frozen parameter (requires_grad False) carries a mark, so that a plan packed for
a LoRA model (frozen base in frozen chunks) is never run on the same model with other parameters
frozen; a model with every parameter trainable hashes as before the mark existed. Torch-free:
callers pass plain names, shapes and dtype strings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any


def fingerprint(params: Iterable[tuple[str, Sequence[int], str] | tuple[str, Sequence[int], str, bool]]) -> str:
    """Hashes a model's parameter list.

    Args:
        params: (name, shape, dtype) or (name, shape, dtype, trainable) for each parameter in
            named_parameters() order; dtype as torch prints it without the "torch." prefix (e.g.
            "float32"); trainable defaults to True.

    Returns:
        16 hex digits.
    """
    digest = hashlib.sha256()
    for name, shape, dtype, *rest in params:
        frozen = ":frozen" if rest and not rest[0] else ""
        digest.update(f"{name}:{','.join(str(int(s)) for s in shape)}:{dtype}{frozen};".encode())
    return digest.hexdigest()[:16]


def model_fingerprint(model: Any) -> str:
    """The fingerprint of a module (anything with ``named_parameters()``), live or on the meta device.

    The one recipe the profiler and the engine share: parameter names, shapes, dtypes and whether
    each is trained, in ``named_parameters()`` order, dtypes as torch prints them without "torch.".
    """
    return fingerprint(
        (name, list(param.shape), str(param.dtype).removeprefix("torch."), bool(param.requires_grad))
        for name, param in model.named_parameters()
    )
