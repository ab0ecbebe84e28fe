"""Hub model names from the local Hugging Face cache, without network: a cache laid out under a tmp HF_HOME as
``huggingface_hub`` lays it out (blobs, a snapshot of symlinks, refs/main; its own ``scan_cache_dir`` reads it)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from elixir_tune.hf_cache import ModelNotCachedError, cached_model_dir, hub_cache_dir, looks_like_hub_name

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model(hub_cache: Path, repo_id: str, files: dict[str, str]) -> Path:
    """Writes ``files`` into the cache as a download of ``repo_id`` at COMMIT would; returns the snapshot dir."""
    from huggingface_hub.file_download import repo_folder_name

    repo = hub_cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        blob = repo / "blobs" / hashlib.sha256(text.encode()).hexdigest()
        blob.write_text(text)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
    return tmp_path / "hf"


def test_a_cached_name_resolves_to_its_snapshot_and_builds(hf_home: Path, monkeypatch, tmp_path: Path):
    from huggingface_hub import scan_cache_dir
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=300
    )
    snapshot = cache_model(hf_home / "hub", "tiny-org/tiny-llama", {"config.json": config.to_json_string()})
    assert [repo.repo_id for repo in scan_cache_dir(hf_home / "hub").repos] == ["tiny-org/tiny-llama"]
    assert hub_cache_dir() == hf_home / "hub"
    monkeypatch.chdir(tmp_path)
    assert looks_like_hub_name("tiny-org/tiny-llama") and not looks_like_hub_name("configs/model.yaml")
    assert cached_model_dir("tiny-org/tiny-llama") == snapshot

    from elixir_tune.profiler import load_model_source

    source = load_model_source("tiny-org/tiny-llama")  # what `elixir-tune profile NAME` and a plan's source use
    assert source.name == "tiny-llama" and source.vocab_size == 300


def test_a_name_not_in_the_cache_says_where_it_looked(hf_home: Path):
    with pytest.raises(ModelNotCachedError) as caught:
        cached_model_dir("meta-llama/Llama-2-7b-hf")
    message = str(caught.value)
    assert message.startswith("meta-llama/Llama-2-7b-hf: not a directory and not in the local Hugging Face cache")
    assert (
        str(hf_home / "hub") in message and "HF_HOME" in message and "hf download meta-llama/Llama-2-7b-hf" in message
    )
    assert "\n" not in message

    from elixir_tune.profiler import ModelSourceError, load_model_source

    with pytest.raises(ModelSourceError, match="not in the local Hugging Face cache"):
        load_model_source("meta-llama/Llama-2-7b-hf")


def test_a_snapshot_without_config_is_refused(hf_home: Path):
    cache_model(hf_home / "hub", "tiny-org/weights-only", {"model.safetensors": "not really"})
    with pytest.raises(ModelNotCachedError, match="has no config.json"):
        cached_model_dir("tiny-org/weights-only")


def test_the_recipes_and_profile_take_a_cached_name(hf_home: Path, tmp_path: Path, monkeypatch):
    """`--model NAME` (and a plan's model.source) and `elixir-tune profile NAME`, from a directory with no model."""
    from click.testing import CliRunner
    from transformers import LlamaConfig

    from elixir_tune.cli.main import cli
    from elixir_tune.recipes.options import resolve_model_dir

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=300
    )
    snapshot = cache_model(hf_home / "hub", "tiny-org/tiny-llama", {"config.json": config.to_json_string()})
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("tiny-org/tiny-llama", str(tmp_path / "plan.yaml")) == snapshot
    result = CliRunner().invoke(cli, ["profile", "tiny-org/tiny-llama", "--batch-size", "2", "--seq-len", "16"])
    assert result.exit_code == 0, result.output
    assert "source: tiny-org/tiny-llama" in (tmp_path / "profile.yaml").read_text()
    result = CliRunner().invoke(cli, ["profile", "tiny-org/not-cached"])
    assert result.exit_code != 0 and "not in the local Hugging Face cache" in result.output
