"""Options and inputs that used to be taken in silence: each now ends in one line with what to do."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from elixir_tune.cli.main import cli
from elixir_tune.cli.run import run_command
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.paths import CONFIGS_DIR, REPO_DIR
from elixir_tune.profiler.schema import save_profile

EXAMPLE_PLAN = REPO_DIR / "configs" / "plans" / "example.yaml"


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_collective_timeout_that_is_not_finite_is_bad_usage(value):
    result = CliRunner().invoke(run_command, ["--collective-timeout", value, str(EXAMPLE_PLAN), "train.py"])
    assert result.exit_code == 2 and f"'{value}' is not a finite number" in result.output


def test_a_key_pinned_twice_to_different_values_is_refused(tmp_path):
    profile = tmp_path / "profile.yaml"
    save_profile(gpt2_profile(), profile)
    args = ["search", "--gpus", "2", "--hardware", "cpu", "--profile", str(profile), "--out", str(tmp_path / "p.yaml")]
    result = CliRunner().invoke(cli, [*args, "--fix", "offload=0.5", "--fix", "offload=0.9"])
    assert result.exit_code != 0 and "--fix offload is given twice (0.5 and 0.9); pin it once" in result.output
    assert not (tmp_path / "p.yaml").exists()


def test_an_output_named_like_an_input_is_refused_and_the_input_kept(tmp_path):
    model = tmp_path / "model.yaml"
    shutil.copy(CONFIGS_DIR / "models" / "gpt2-tiny.yaml", model)
    before = model.read_text()
    result = CliRunner().invoke(cli, ["profile", str(model), "--out", str(model)])
    assert result.exit_code == 2 and "is the file given as MODEL" in result.output
    assert model.read_text() == before
    profile = tmp_path / "profile.yaml"
    save_profile(gpt2_profile(), profile)
    before = profile.read_text()
    result = CliRunner().invoke(
        cli, ["search", "--gpus", "2", "--hardware", "cpu", "--profile", str(profile), "--out", str(profile)]
    )
    assert result.exit_code == 2 and "is the file given as --profile" in result.output
    assert profile.read_text() == before


def test_a_tokenizer_with_remote_code_is_refused_without_asking(tmp_path):
    from elixir_tune.recipes.finetune import load_tokenizer

    marker = tmp_path / "ran"
    (tmp_path / "tokenizer_config.json").write_text(
        '{"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", null]}, "tokenizer_class": "EvilTokenizer"}'
    )
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="contains custom code"):
        load_tokenizer(tmp_path)
    assert not marker.exists()


def test_bench_with_missing_data_fails_before_any_trial(tmp_path):
    result = CliRunner().invoke(cli, ["bench", str(EXAMPLE_PLAN), "--data", str(tmp_path / "none.txt")])
    assert result.exit_code == 1 and "none.txt: no such file or directory" in result.output
