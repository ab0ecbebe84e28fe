"""The small answers of issue 36, each one line that says what is wrong and what to do: a profile or a hardware
file given where the plan goes, option and recipe typos with the closest name, and a CPU search for more workers
than this machine has cores. Nothing here starts a worker."""

from __future__ import annotations

import os
from pathlib import Path

from click.testing import CliRunner

from elixir_tune.cli.main import cli
from elixir_tune.cli.run import run_command
from elixir_tune.paths import REPO_DIR

EXAMPLE_PLAN = REPO_DIR / "configs" / "plans" / "example.yaml"
CPU_HARDWARE = REPO_DIR / "configs" / "hardware" / "cpu.yaml"


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def test_a_profile_or_hardware_file_given_as_the_plan_says_what_it_is(tmp_path: Path):
    profile = tmp_path / "profile.yaml"
    result = CliRunner().invoke(cli, ["profile", "gpt2-tiny", "-b", "2", "-s", "16", "--out", str(profile)])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(run_command, [str(profile), "pretrain"])
    assert result.exit_code == 2
    assert _errors(result.output) == [
        f"error: {profile}: this is a profile (written by `elixir-tune profile`), not a plan: make a plan from it "
        f"with `elixir-tune search --gpus N --profile {profile}`, then give that plan"
    ]
    validated = CliRunner().invoke(cli, ["validate", str(profile)])
    said = " ".join(validated.output.split())  # rich wraps long lines
    assert validated.exit_code == 1 and "1 problem(s) - this is a profile" in said
    result = CliRunner().invoke(run_command, [str(CPU_HARDWARE), "pretrain"])
    assert result.exit_code == 2 and _errors(result.output)[0].startswith(
        f"error: {CPU_HARDWARE}: this is a hardware description (written by `elixir-tune probe`), not a plan"
    )


def test_typos_get_the_closest_name(tmp_path: Path):
    result = CliRunner().invoke(run_command, ["--dryrun", str(EXAMPLE_PLAN), "pretrain"])
    assert result.exit_code == 2 and _errors(result.output) == [
        "error: no such option: --dryrun (did you mean --dry-run?)"
    ]
    result = CliRunner().invoke(run_command, ["--monitor-interval", "1", "--dry-run", str(EXAMPLE_PLAN), "pretrain"])
    assert _errors(result.output) == [
        "error: elixir-run's own --dry-run comes after a torchrun option: put elixir-run's options first"
    ]
    result = CliRunner().invoke(run_command, [str(EXAMPLE_PLAN), "pretrain", "--stepz", "3", "--eval-evry", "2"])
    assert _errors(result.output) == [
        "error: pretrain: unrecognized arguments: --stepz 3 --eval-evry 2 (did you mean --steps or --eval-every?)"
    ]
    result = CliRunner().invoke(run_command, [str(EXAMPLE_PLAN), "finetun"])
    assert _errors(result.output)[0].startswith(
        "error: 'finetun' is neither a recipe nor a file (did you mean finetune?)"
    )
    result = CliRunner().invoke(cli, ["search", "--glbal-batch-size", "4"])
    assert result.exit_code == 2 and "Did you mean '--global-batch-size'?" in result.output


def test_a_cpu_search_for_more_workers_than_cores_is_warned(tmp_path: Path):
    previous = Path.cwd()
    os.chdir(tmp_path)
    try:
        assert CliRunner().invoke(cli, ["profile", "gpt2-tiny", "-b", "2", "-s", "16"]).exit_code == 0
        cores = os.cpu_count() or 1
        too_many = CliRunner().invoke(cli, ["search", "--gpus", str(cores * 4), "--hardware", "cpu"])
        fits = CliRunner().invoke(cli, ["search", "--gpus", "1", "--hardware", "cpu", "--out", "fits.yaml"])
        gpu = CliRunner().invoke(
            cli, ["search", "--gpus", str(cores * 4), "--hardware", "a100-40gb-pcie", "--out", "gpu.yaml"]
        )
    finally:
        os.chdir(previous)
    assert too_many.exit_code == 0, too_many.output  # warned, and the plan is still written
    output = " ".join(too_many.output.split())
    assert (
        f"warning: --gpus {cores * 4} asks for {cores * 4} CPU worker processes per node, and this machine has "
        in output
    )
    assert f"search with --gpus {cores} or fewer for this machine" in output
    assert fits.exit_code == 0 and "warning" not in fits.output
    assert gpu.exit_code == 0 and "warning" not in gpu.output  # a GPU plan is for another machine


def test_lora_reaches_the_user_without_dependency_warnings():
    """PEFT calls transformers' deprecated is_gradient_checkpointing (a FutureWarning once per rank and once in
    elixir-run's preflight): apply_lora keeps it to itself, and other warnings still pass."""
    import warnings

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from elixir_tune.models.lora import apply_lora

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(model, rank=4, target_modules="q_proj,v_proj")
        warnings.warn("still shown", UserWarning, stacklevel=1)
    assert [str(warning.message) for warning in caught] == ["still shown"]


def test_the_profile_default_sequence_length_fits_the_model_positions(tmp_path: Path):
    """A model with 256 positions is profiled at 256 by default (it was 1024, refused with a format hint)."""
    import json

    from transformers import LlamaConfig

    model_dir = tmp_path / "short"
    LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=300,
        max_position_embeddings=256,
    ).save_pretrained(model_dir)
    result = CliRunner().invoke(
        cli, ["profile", str(model_dir), "-b", "1", "--out", str(tmp_path / "p.yaml"), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["seq_len"] == 256
    longer = CliRunner().invoke(cli, ["profile", str(model_dir), "-b", "1", "-s", "512", "--out", str(tmp_path / "q")])
    assert longer.exit_code == 1 and "seq_len 512 is longer than the model's 256 positions" in longer.output


# Each runs in a fresh interpreter; what it prints last is whether torch or transformers got imported.
NO_HEAVY_IMPORTS = {
    "elixir-tune --help": "from elixir_tune.cli.main import cli; cli(['--help'])",
    "elixir-tune train --help": "from elixir_tune.cli.main import cli; cli(['train', '--help'])",
    "elixir-run --help": "from elixir_tune.cli.run import run_command; run_command(['--help'])",
    "elixir-run: missing data file": "from elixir_tune.cli.run import run_command; "
    f"run_command([{str(EXAMPLE_PLAN)!r}, 'finetune', '--model', 'MODEL', '--data', 'missing.jsonl'])",
    "elixir-tune train: missing data file": "from elixir_tune.cli.main import cli; "
    "cli(['train', 'MODEL', '--data', 'missing.jsonl'])",
    **{
        f"elixir-run PLAN {recipe} {option}": "from elixir_tune.cli.run import run_command; "
        f"run_command([{str(EXAMPLE_PLAN)!r}, {recipe!r}, {option!r}])"
        for recipe in ("pretrain", "finetune")
        for option in ("--help", "--stepz")
    },
}


def test_help_and_a_missing_data_file_import_no_torch(tmp_path: Path):
    """What makes them answer in a fraction of a second (scripts/bench_cli_latency.py times them): torch and
    transformers, seconds of imports, stay out. Not a timed test: a structural one that fails when an import comes
    back to these paths."""
    import subprocess
    import sys

    (tmp_path / "MODEL").mkdir()
    (tmp_path / "MODEL" / "config.json").write_text('{"model_type": "llama"}')
    for name, code in NO_HEAVY_IMPORTS.items():
        probe = (
            f"import atexit, sys\natexit.register(lambda: print('heavy:', sorted({{'torch', 'transformers'}} & "
            f"set(sys.modules))))\n{code}"
        )
        result = subprocess.run(
            [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert result.stdout.strip().splitlines()[-1] == "heavy: []", (
            name,
            result.stdout[-2000:],
            result.stderr[-2000:],
        )
