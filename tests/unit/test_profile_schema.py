"""Profile files are checked against the profile dataclasses (the same typed-field machinery as
the plan): a malformed profile lists every problem with its field path instead of a TypeError."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.profiler import ModelProfile, load_profile, save_profile
from elixir_tune.profiler.schema import profile_problems


@pytest.fixture
def raw() -> dict:
    return gpt2_profile("gpt2-tiny", seq_len=32, dtype="fp32").to_dict()


def test_a_valid_profile_round_trips(tmp_path: Path, raw: dict):
    assert profile_problems(raw) == []
    path = tmp_path / "profile.yaml"
    save_profile(ModelProfile.from_dict(raw), path)
    assert load_profile(path).to_dict() == raw


def test_every_problem_is_listed(tmp_path: Path, raw: dict):
    raw["seq_len"] = 0
    raw["dtype"] = "fp8"
    raw["params"][1]["numel"] = "many"
    raw["activation"] = {"fixed_bytes": -1, "per_sample_bytes": 10, "slope": 2}
    del raw["fingerprint"]
    raw["colour"] = "red"
    assert profile_problems(raw) == [
        "fingerprint: missing (expected a string)",
        "dtype: unknown value 'fp8' (expected one of fp32, bf16, fp16)",
        "seq_len: must be positive, got 0",
        "params[1].numel: expected an integer, got 'many'",
        "activation.fixed_bytes: must not be negative, got -1",
        "activation.slope: unknown field (known: fixed_bytes, per_sample_bytes)",
        "colour: unknown field (known: " + ", ".join(ModelProfile.__dataclass_fields__) + ")",
    ]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=r"7 problem\(s\)") as caught:
        load_profile(path)
    assert "params[1].numel: expected an integer" in str(caught.value)
    assert "elixir-tune profile" in str(caught.value)
