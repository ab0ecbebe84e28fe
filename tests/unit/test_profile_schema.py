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


def test_fields_that_contradict_each_other_are_listed(raw: dict):
    """Each well-typed on its own; together no model: the search would plan from nonsense."""
    raw["num_params"] += 1
    raw["trace_checkpointed"] = [[len(raw["params"])]]
    raw["blocks"][1]["index"] = 5
    assert profile_problems(raw) == [
        f"num_params: {raw['num_params']}, but the parameters listed hold {raw['num_params'] - 1}",
        f"trace_checkpointed: parameter index {len(raw['params'])} is beyond the {len(raw['params'])} "
        "parameters listed",
        "blocks[1].index: expected 1, got 5",
    ]


def test_an_empty_trace_is_refused(raw: dict):
    raw["trace"] = []
    assert profile_problems(raw) == [
        "trace: empty, but the model has trainable parameters: no operation of the step reads them"
    ]


def test_a_model_yaml_of_minus_one_layers_is_refused(tmp_path: Path):
    from elixir_tune.profiler import ModelSourceError, load_model_source

    path = tmp_path / "neg.yaml"
    path.write_text("architecture: gpt2\nconfig: {n_layer: -1, n_embd: 64, n_head: 4, vocab_size: 256}\n")
    with pytest.raises(ModelSourceError, match="config num_hidden_layers is -1; a model needs at least 1"):
        load_model_source(str(path))


def test_a_profile_written_before_the_architecture_numbers_loads(tmp_path: Path, raw: dict):
    del raw["arch"]
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(raw))
    arch = load_profile(path).arch
    assert (arch.model_type, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == ("", 0, 0, 0)


def test_architecture_numbers_come_from_the_hf_config():
    from types import SimpleNamespace

    from transformers import GPT2Config, LlamaConfig, OPTConfig

    from elixir_tune.profiler.arch import model_arch

    llama = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=160)
    arch = model_arch(SimpleNamespace(config=llama))
    assert (arch.model_type, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == ("llama", 64, 8, 2)
    assert arch.intermediate_size == 160 and arch.num_layers == llama.num_hidden_layers
    gpt2 = model_arch(SimpleNamespace(config=GPT2Config(n_embd=96, n_head=4, n_layer=3, vocab_size=500)))
    assert (gpt2.hidden_size, gpt2.num_heads, gpt2.num_kv_heads, gpt2.intermediate_size) == (96, 4, 4, 384)
    assert (gpt2.num_layers, gpt2.vocab_size) == (3, 500)
    assert model_arch(SimpleNamespace(config=OPTConfig(ffn_dim=1000))).intermediate_size == 1000
    assert model_arch(object()).model_type == ""  # no HF config: unknown
