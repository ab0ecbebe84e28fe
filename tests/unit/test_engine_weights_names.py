"""Hugging Face naming when loading weights: base-model prefixes both ways, tied heads left out of the
file, and the model class's ignorable keys (GPT-2's old ``attn.bias`` masks). One process, world 1."""

from __future__ import annotations

import pytest
import torch

import elixir_tune
from tests.distributed.engine_plans import make_plan
from tests.distributed.engine_weights_worker import hf_config


def load_meta(model_class, config, weights) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = model_class(config)
    model, _ = elixir_tune.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), make_plan(model, 1, 8192), weights)
    return model.state_dict()


def assert_same(loaded: dict, expected: dict, strip: str = "", add: str = "") -> None:
    compared = 0
    for name, value in expected.items():
        key = add + name.removeprefix(strip)
        if key in loaded:
            assert torch.equal(loaded[key], value.float()), key
            compared += 1
    assert compared >= len(expected) - 1, (compared, len(expected))


def test_base_model_checkpoint_into_lm_model(tmp_path):
    """GPT2Model saves names without ``transformer.``; the LM model's tied head comes from wte."""
    from transformers import GPT2LMHeadModel, GPT2Model

    base = GPT2Model(hf_config("gpt2"))
    base.save_pretrained(tmp_path)
    loaded = load_meta(GPT2LMHeadModel, hf_config("gpt2"), tmp_path)
    assert_same(loaded, base.state_dict(), add="transformer.")
    assert torch.equal(loaded["lm_head.weight"], base.state_dict()["wte.weight"])


def test_lm_checkpoint_into_base_model(tmp_path):
    from transformers import GPT2LMHeadModel, GPT2Model

    lm = GPT2LMHeadModel(hf_config("gpt2"))
    lm.save_pretrained(tmp_path)  # transformers leaves the tied lm_head.weight out of the file
    loaded = load_meta(GPT2Model, hf_config("gpt2"), tmp_path)
    assert_same(loaded, lm.state_dict(), strip="transformer.")


def test_tied_llama_from_its_base_model(tmp_path):
    from transformers import LlamaForCausalLM, LlamaModel

    config = hf_config("llama")
    config.tie_word_embeddings = True
    base = LlamaModel(config)
    base.save_pretrained(tmp_path)
    loaded = load_meta(LlamaForCausalLM, config, tmp_path)
    assert_same(loaded, base.state_dict(), add="model.")
    assert torch.equal(loaded["lm_head.weight"], base.state_dict()["embed_tokens.weight"])


def test_untied_llama_from_its_base_model_misses_the_head(tmp_path):
    from transformers import LlamaForCausalLM, LlamaModel

    LlamaModel(hf_config("llama")).save_pretrained(tmp_path)
    with pytest.raises(elixir_tune.engine.WeightsError, match=r"1 missing: lm_head\.weight\."):
        load_meta(LlamaForCausalLM, hf_config("llama"), tmp_path)


def test_old_gpt2_files_with_attention_mask_buffers(tmp_path):
    """The original GPT-2 files hold ``h.N.attn.bias`` causal masks: ignorable, as in transformers."""
    from safetensors.torch import save_file
    from transformers import GPT2LMHeadModel, GPT2Model

    base = GPT2Model(hf_config("gpt2"))
    state = {k: v.contiguous() for k, v in base.state_dict().items()}
    for layer in range(2):
        state[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_meta(GPT2LMHeadModel, hf_config("gpt2"), tmp_path)
    assert_same(loaded, base.state_dict(), add="transformer.")


def test_dtype_conversion_from_bf16(tmp_path):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(hf_config("gpt2")).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    loaded = load_meta(GPT2LMHeadModel, hf_config("gpt2"), tmp_path)
    assert loaded["transformer.wte.weight"].dtype == torch.float32
    assert_same(loaded, model.state_dict())
