"""Bad weights and uninitializable meta models: each a clear error from ``setup``, before any training.

One process (a world of one needs no group); tiny transformers models built from configs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import elixir_tune
from elixir_tune.engine import MaterializeError, WeightsError
from tests.distributed.engine_plans import make_plan
from tests.distributed.engine_weights_worker import hf_config


def meta_gpt2(**overrides) -> nn.Module:
    from transformers import GPT2LMHeadModel

    config = hf_config("gpt2")
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def setup_with(model: nn.Module, weights=None):
    optimizer = torch.optim.AdamW(model.parameters())
    return elixir_tune.setup(model, optimizer, plan=make_plan(model, 1, 4096), weights=weights)


@pytest.fixture(scope="module")
def gpt2_file(tmp_path_factory) -> str:
    from safetensors.torch import save_file
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(hf_config("gpt2"))
    path = tmp_path_factory.mktemp("w") / "gpt2.safetensors"
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(path))
    return str(path)


def test_weights_of_another_model(tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(hf_config("llama")).save_pretrained(tmp_path)
    with pytest.raises(
        WeightsError, match=r"do not match the model GPT2LMHeadModel: \d+ missing: .*unexpected: .*model\."
    ):
        setup_with(meta_gpt2(), tmp_path)


def test_missing_tensor(gpt2_file, tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(gpt2_file)
    del state["transformer.h.1.mlp.c_fc.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"1 missing: transformer\.h\.1\.mlp\.c_fc\.weight\."):
        setup_with(meta_gpt2(), tmp_path)


def test_shape_mismatch(gpt2_file):
    with pytest.raises(
        WeightsError, match=r"1 wrongly shaped: transformer\.wpe\.weight \(file \[32, 32\], model \[64, 32\]\)"
    ):
        setup_with(meta_gpt2(n_positions=64), gpt2_file)


def test_truncated_file(gpt2_file, tmp_path):
    data = open(gpt2_file, "rb").read()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(
        WeightsError, match=r"model\.safetensors is not a readable safetensors file \(truncated or corrupt"
    ):
        setup_with(meta_gpt2(), tmp_path)


def test_corrupt_file(gpt2_file, tmp_path):
    data = bytearray(open(gpt2_file, "rb").read())
    data[8:40] = b"#" * 32  # the JSON header
    path = tmp_path / "broken.safetensors"
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=r"broken\.safetensors is not a readable safetensors file"):
        setup_with(meta_gpt2(), path)


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WeightsError, match=r"has no model\.safetensors.*pytorch_model\.bin: only safetensors are read"):
        setup_with(meta_gpt2(), tmp_path)


class Scaled(nn.Module):
    """A parameter built in __init__ (torch.ones) with no reset_parameters: on meta, nothing can set it."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.scale


def test_meta_params_without_initializer():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), Scaled())
    with pytest.raises(
        MaterializeError,
        match=r"nothing can initialize: 1\.scale \(Scaled\)\. Their modules have no reset_parameters\(\)",
    ):
        setup_with(model)


def test_initializer_that_leaves_a_parameter_unset():
    class Partial(nn.Linear):
        def __init__(self):
            super().__init__(8, 8)
            self.extra = nn.Parameter(torch.zeros(8))  # reset_parameters() does not touch it

    with torch.device("meta"):
        model = nn.Sequential(Partial())
    with pytest.raises(MaterializeError, match=r"left 1 tensor\(s\) of .* unset .*: 0\.extra"):
        setup_with(model)


def test_meta_model_initializes_without_weights():
    """The contrast to the errors above: the same models build fine when they can be initialized."""
    model, _ = setup_with(meta_gpt2())
    state = model.state_dict()
    assert all(not v.is_meta and torch.isfinite(v).all() for v in state.values())
    assert state["transformer.h.0.ln_1.weight"].eq(1).all()  # transformers' LayerNorm init
    assert 0.01 < float(state["transformer.wte.weight"].std()) < 0.03  # initializer_range 0.02


def test_meta_params_without_initializer_load_from_weights(tmp_path):
    """No initializer is needed for what the weights provide."""
    from safetensors.torch import save_file

    save_file(
        {"0.weight": torch.ones(8, 8), "0.bias": torch.zeros(8), "1.scale": torch.full((8,), 2.0)},
        str(tmp_path / "w.safetensors"),
    )
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), Scaled())
    model, _ = setup_with(model, tmp_path / "w.safetensors")
    assert model.state_dict()["1.scale"].eq(2).all()
