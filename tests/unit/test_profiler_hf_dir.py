"""A Hugging Face model directory as MODEL: built from its config.json on the meta device, no weights read."""

from __future__ import annotations

import json

import pytest
import torch

from elixir_tune.profiler import ModelSourceError, load_model_source
from tests.distributed.engine_weights_worker import hf_config


def test_directory_builds_from_config_only(tmp_path):
    hf_config("llama").save_pretrained(tmp_path)  # config.json only: nothing to read weights from
    source = load_model_source(str(tmp_path))
    assert source.name == tmp_path.name and source.vocab_size == 64 and source.max_seq_len == 64
    with torch.device("meta"):
        model = source.build_model()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(p.is_meta for p in model.parameters())
    assert model.config.use_cache is False  # training keeps no KV cache, whatever config.json says
    assert source.example_batch(2, 8)["input_ids"].shape == (2, 8)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelSourceError, match="needs a config.json"):
        load_model_source(str(tmp_path))


def test_config_without_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelSourceError, match="no model_type"):
        load_model_source(str(tmp_path))
