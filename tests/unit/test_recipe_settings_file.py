"""A recipe's settings file (issue "What a newcomer meets"): ``--config run.yaml`` and ``KEY=VALUE`` overrides set
the options (the file < the overrides < the flags), every wrong key or value is one line naming it, and the file a
run writes back reads to the same options."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from elixir_tune.recipes import finetune, pretrain
from elixir_tune.recipes.export_dir import export_dir_problem
from elixir_tune.recipes.options import OptionsError, parse_options
from elixir_tune.recipes.settings_file import SETTINGS_NAME, settings_paths, settings_text


def _finetune(argv: list) -> argparse.Namespace:
    return parse_options(finetune.build_parser(), [str(arg) for arg in argv], for_preflight=True)


def _refusal(argv: list, recipe=finetune) -> str:
    with pytest.raises(OptionsError) as caught:
        parse_options(recipe.build_parser(), [str(arg) for arg in argv], for_preflight=True)
    return str(caught.value)


@pytest.fixture
def run_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text("steps: 200\nlr: 3e-4\ndata: chats.jsonl\nsave-pretrained: out\npacking: true\nseed: 5\n")
    return path


def test_the_file_sets_the_options_by_name_and_typed(run_yaml: Path):
    args = _finetune(["--config", run_yaml])
    assert (args.steps, args.lr, args.data, args.save_pretrained, args.packing) == (
        200,
        3e-4,
        "chats.jsonl",
        "out",
        True,
    )
    assert isinstance(args.steps, int) and isinstance(args.lr, float)
    assert args.epochs is None and args.format == "auto"  # the rest keep their defaults


def test_overrides_beat_the_file_and_flags_beat_both(run_yaml: Path):
    args = _finetune(["--config", run_yaml, "lr=1e-5", "seed=7", "--seed", "9", "packing=false", "text_mode=line"])
    assert (args.lr, args.seed, args.packing, args.text_mode, args.steps) == (1e-5, 9, False, "line", 200)
    # of options that exclude each other, the higher level's stays: --epochs unsets the file's steps
    args = _finetune(["--config", run_yaml, "--epochs", "2"])
    assert (args.steps, args.epochs) == (None, 2.0)
    args = _finetune(["--config", run_yaml, "epochs=0.5"])
    assert (args.steps, args.epochs) == (None, 0.5)


def test_an_options_value_holding_equals_stays_its_value():
    args = _finetune(["--data", "a=b.txt", "--lora-rank", "8", "lora_targets=q_proj,v_proj"])
    assert (args.data, args.lora_rank, args.lora_targets) == ("a=b.txt", 8, "q_proj,v_proj")


def test_an_unknown_key_names_the_closest_option(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 3\n")
    assert _refusal(["--config", bad], pretrain) == (
        f"--config {bad}: 'stepz': no option of this recipe has that name (did you mean --steps?); "
        "`elixir-run PLAN pretrain --help` lists them"
    )
    assert _refusal(["save_pretraind=out"]).startswith("save_pretraind=out: no option of this recipe has that name")
    assert "(did you mean --save-pretrained?)" in _refusal(["save_pretraind=out"])
    assert _refusal(["config=other.yaml"]).startswith("config=other.yaml: no option")  # no file names another


@pytest.mark.parametrize(
    ("argv_or_file", "expected"),
    [
        (["steps=many"], "steps=many: --steps must be a whole number, not 'many'"),
        ("steps: 2.5\n", ": steps: --steps must be a whole number, not 2.5"),
        (["packing=2"], "packing=2: --packing is a switch: give true or false, not 2"),
        (["lr=null"], "lr=null: --lr needs a value (default 0.0001); give one or drop it"),
        (["format=xml"], "format=xml: --format must be one of auto, text, prompt_completion, messages, not 'xml'"),
        ("data: [a, b]\n", ": data: --data takes one value, not ['a', 'b']"),
        ("steps: 3\nepochs: 2\n", ": steps and epochs exclude each other: give one of them"),
        (["lr=-1"], "--lr must be a finite number above 0 (e.g. --lr 3e-4), not -1"),  # the usual range checks
    ],
)
def test_a_value_that_does_not_fit_its_option_is_one_line(tmp_path: Path, argv_or_file, expected: str):
    if isinstance(argv_or_file, str):
        path = tmp_path / "run.yaml"
        path.write_text(argv_or_file)
        argv_or_file, expected = ["--config", path], f"--config {path}{expected}"
    assert _refusal(argv_or_file) == expected


def test_unusable_files_are_one_line(tmp_path: Path):
    bomb = tmp_path / "bomb.yaml"
    lines = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb.write_text("\n".join(lines) + "\n")
    assert "aliases expand to more than 1,000,000 values (a YAML alias bomb?)" in _refusal(["--config", bomb])
    assert _refusal(["--config", tmp_path / "no.yaml"]).startswith(f"--config {tmp_path / 'no.yaml'}: no such settings")
    (tmp_path / "list.yaml").write_text("- steps\n")
    assert "not a settings (a mapping of fields)" in _refusal(["--config", tmp_path / "list.yaml"])


def test_the_written_settings_read_back_to_the_same_options(run_yaml: Path, tmp_path: Path):
    args = _finetune(["--config", run_yaml, "lr=1e-5", "--save", tmp_path / "ckpt", "--epochs", "2"])
    written = tmp_path / "again.yaml"
    written.write_text(settings_text(args, "finetune"))
    again = _finetune(["--config", written])
    assert vars(again) == {**vars(args), "config": str(written)}


def test_where_the_settings_go(tmp_path: Path):
    def paths(**given) -> list[Path]:
        return settings_paths(
            argparse.Namespace(**{"save": None, "save_pretrained": None, "log": "runs/t.json", **given})
        )

    assert paths() == [Path("runs/t.settings.yaml")]
    assert paths(log="") == []
    assert paths(save="ckpt", save_pretrained="out") == [Path("ckpt") / SETTINGS_NAME, Path("out") / SETTINGS_NAME]
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    assert paths(save_pretrained=str(theirs)) == []  # the export refuses the folder: nothing of the run goes there
    # the next run's export check does not take the settings for the user's files
    out = tmp_path / "out"
    out.mkdir()
    (out / SETTINGS_NAME).write_text("steps: 1\n")
    assert export_dir_problem(str(out)) is None
