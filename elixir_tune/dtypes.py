"""Compute dtypes by the plan's names (fp32, bf16, fp16) and back. Imports torch: only modules that
already use torch (profiler, hardware probe, engine) import this one."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Other spellings accepted on the command line.
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}


def dtype_name(dtype: torch.dtype) -> str:
    """The plan's name of a torch dtype (``torch.bfloat16`` -> ``bf16``); other dtypes as torch
    prints them without the ``torch.`` prefix (``int64``)."""
    for name, value in TORCH_DTYPES.items():
        if value == dtype:
            return name
    return str(dtype).removeprefix("torch.")
