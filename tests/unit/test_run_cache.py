"""The keys of `elixir-tune train`'s cache: the same model files and settings give the same key, a change of
either (a config edited, another sequence length) another; the model's files are found for every MODEL form."""

from __future__ import annotations

from pathlib import Path

import pytest

from elixir_tune import run_cache
from elixir_tune.paths import MODEL_CONFIGS_DIR


def test_the_files_that_decide_a_profile(tmp_path: Path):
    (tmp_path / "model").mkdir()
    config = tmp_path / "model" / "config.json"
    config.write_text("{}")
    script = tmp_path / "net.py"
    script.write_text("def build_model(): ...\n")
    assert run_cache.model_files(str(tmp_path / "model")) == [config]
    assert run_cache.model_files(f"{script}:build_model") == [script]
    assert run_cache.model_files("gpt2-tiny") == [MODEL_CONFIGS_DIR / "gpt2-tiny.yaml"]
    assert run_cache.model_files(str(tmp_path / "missing")) == []
    (tmp_path / "empty").mkdir()
    assert run_cache.model_files(str(tmp_path / "empty")) == []


def test_a_key_changes_with_the_settings_and_the_files_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    config = tmp_path / "config.json"
    config.write_text('{"hidden_size": 32}')
    key = run_cache.digest({"seq_len": 128}, [config])
    assert key == run_cache.digest({"seq_len": 128}, [config]) and len(key) == run_cache.KEY_CHARS
    assert key != run_cache.digest({"seq_len": 64}, [config])
    config.write_text('{"hidden_size": 64}')
    assert key != run_cache.digest({"seq_len": 128}, [config])
    monkeypatch.setenv(run_cache.CACHE_ENV_VAR, str(tmp_path / "c"))
    assert run_cache.plan_path(key) == tmp_path / "c" / "plans" / f"plan-{key}.yaml"
    monkeypatch.delenv(run_cache.CACHE_ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert run_cache.profile_path(key) == tmp_path / "xdg" / "elixir-tune" / "profiles" / f"profile-{key}.yaml"
