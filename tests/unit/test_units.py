"""The shared helpers that replaced per-package copies: byte formatting, dtype names, the fingerprint."""

from __future__ import annotations

import torch

from elixir_tune.dtypes import TORCH_DTYPES, dtype_name
from elixir_tune.engine.setup import model_fingerprint as engine_fingerprint
from elixir_tune.plan import fingerprint, model_fingerprint
from elixir_tune.units import gib, human_bytes


def test_byte_formatting():
    assert gib(3 * 2**30) == "3.00 GiB"
    assert gib(2**29, decimals=3) == "0.500 GiB"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(12.3 * 2**20) == "12.3 MiB"
    assert human_bytes(3 * 2**30) == "3 GiB"
    assert human_bytes(100) == "100 B"


def test_dtype_names_round_trip():
    for name, dtype in TORCH_DTYPES.items():
        assert dtype_name(dtype) == name
    assert dtype_name(torch.int64) == "int64"


def test_one_fingerprint_recipe_for_meta_and_live_models():
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    live = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    expected = fingerprint(
        [
            ("0.weight", [4, 3], "float32"),
            ("0.bias", [4], "float32"),
            ("1.weight", [4], "float32"),
            ("1.bias", [4], "float32"),
        ]
    )
    assert model_fingerprint(meta) == model_fingerprint(live) == engine_fingerprint(live) == expected
    assert model_fingerprint(live.to(torch.bfloat16)) != expected
