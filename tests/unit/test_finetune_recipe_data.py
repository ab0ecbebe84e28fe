"""The fine-tuning recipe's data path in one process (world 1): its options become ``elixir_tune.data``'s DataSpec
and each format reaches the batches the loop trains on; the preflight (elixir-run's process, before any worker)
gives one line per bad input: a file that fits no format, messages without a chat template, --packing under a
2D tensor plan (a pipeline plan carries it), LoRA options that are not the plan's, --merge-lora without LoRA."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from elixir_tune.cli.run import run_command
from elixir_tune.data import load_data
from elixir_tune.paths import REPO_DIR
from elixir_tune.plan import load_plan
from elixir_tune.recipes.finetune import build_parser
from elixir_tune.recipes.finetune_options import data_problems, data_spec, lora_flags
from elixir_tune.recipes.options import parse_options
from tests.fixtures.tiny_hf import make_llama_dir, write_formats

EXAMPLE_PLAN = REPO_DIR / "configs" / "plans" / "example.yaml"
SEQ_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_llama_dir(tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return write_formats(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def recipe_data(argv: list[str], tokenizer):
    """The TrainData the recipe's workers build from these options."""
    return load_data(data_spec(parse_options(build_parser(), argv)), tokenizer, SEQ_LEN)


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("txt", "text"),
        ("text_jsonl", "text"),
        ("text_parquet", "text"),
        ("prompt_completion_jsonl", "prompt_completion"),
        ("prompt_completion_csv", "prompt_completion"),
        ("messages_jsonl", "messages"),
        ("messages_dataset", "messages"),
    ],
)
def test_each_format_reaches_the_training_batches(files, tokenizer, name, fmt):
    data = recipe_data(["--data", str(files[name]), "--eval-fraction", "0.25"], tokenizer)
    assert data.format == fmt and data.describe().startswith(f"data: {files[name]}: {fmt} (")
    batch = data.batch(0, 2, 0, 1)
    assert batch["input_ids"].shape == batch["labels"].shape == (2, SEQ_LEN)
    with_loss = batch["labels"] != -100
    assert with_loss.any()
    # Labels are the input tokens where they count; prompts and user turns carry none.
    assert torch.equal(batch["labels"][with_loss], batch["input_ids"][with_loss])
    if fmt != "text":
        assert not with_loss[batch["attention_mask"] == 1].all()
    eval_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in data.eval_batches(2) or [])
    assert eval_tokens > 0


def test_text_modes_and_packing_follow_the_options(files, tokenizer):
    windows = recipe_data(["--data", str(files["txt"])], tokenizer)  # default: packed into full windows
    assert int(windows.batch(0, 4, 0, 1)["attention_mask"].sum()) == 4 * SEQ_LEN
    lines = recipe_data(["--data", str(files["txt"]), "--text-mode", "paragraph"], tokenizer)
    assert lines.num_samples() == 12 and "text mode paragraph" in lines.describe()
    packed = recipe_data(["--data", str(files["prompt_completion_jsonl"]), "--packing"], tokenizer)
    assert packed.packed and packed.num_samples() < 6  # six short pairs share rows
    rows = packed.batch(0, 1, 0, 1)
    assert "attention_mask" not in rows and int((rows["position_ids"][0] == 0).sum()) >= 2
    given = recipe_data(["--data", str(files["text_jsonl"]), "--format", "text", "--text-mode", "document"], tokenizer)
    assert given.num_samples() == 12 and "(given" in given.describe()


def _preflight(args: list, cwd: Path) -> tuple[int, list[str]]:
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(run_command, [str(arg) for arg in [EXAMPLE_PLAN, "finetune", *args]])
    finally:
        os.chdir(previous)
    assert "starting" not in result.output and "Traceback" not in result.output, result.output
    return result.exit_code, [line for line in result.output.splitlines() if line.startswith("error: ")]


def test_bad_data_is_one_line_each_before_any_worker_starts(model_dir, files, tmp_path):
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text('{"question": "a?", "answer": "b"}\n')
    code, errors = _preflight(["--model", model_dir, "--data", unknown], tmp_path)
    assert code == 2 and any(f"{unknown}: fields ['answer', 'question'] fit no format" in e for e in errors), errors

    bare = tmp_path / "no-template"
    bare.mkdir()
    for item in model_dir.iterdir():
        if item.name != "chat_template.jinja":
            (bare / item.name).write_bytes(item.read_bytes())
    assert "chat_template" not in (bare / "tokenizer_config.json").read_text()
    code, errors = _preflight(["--model", bare, "--data", files["messages_jsonl"]], tmp_path)
    assert code == 2 and any("has no chat template, which format messages needs" in e for e in errors), errors

    code, errors = _preflight(["--model", model_dir, "--data", files["txt"], "--merge-lora"], tmp_path)
    assert code == 2 and errors[0] == "error: --merge-lora needs --lora-rank R (e.g. 8): add it, or drop it"
    assert errors[1] == "error: --merge-lora writes the merged model to --save-pretrained DIR: add --save-pretrained"


def test_lora_options_must_be_the_plans(model_dir, files, tmp_path):
    """The example plan has no LoRA: asking for it names the profile command that would make one."""
    argv = ["--model", model_dir, "--data", files["txt"], "--lora-rank", "4", "--lora-targets", "q_proj"]
    code, errors = _preflight(argv, tmp_path)
    assert code == 2 and errors == [
        f"error: the plan was made without LoRA: profile with the same options (`elixir-tune profile {model_dir} "
        "--lora-rank 4 --lora-alpha 8 --lora-targets q_proj`) and search again, or drop the --lora-* options"
    ]
    settings = {"rank": 8, "alpha": 16.0, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}
    assert lora_flags(settings) == "--lora-rank 8 --lora-alpha 16 --lora-dropout 0.05 --lora-targets q_proj,v_proj"


def test_packing_is_refused_where_the_plan_does_not_carry_position_ids(files):
    args = parse_options(build_parser(), ["--data", str(files["messages_jsonl"]), "--packing"])
    plain = load_plan(str(EXAMPLE_PLAN))
    assert data_problems(args, plain) == ([], "messages")
    pipeline = copy.deepcopy(plain)
    pipeline.parallel.pipeline.stages = 2  # every stage passes the position ids to the model
    assert data_problems(args, pipeline) == ([], "messages")
    grid = copy.deepcopy(plain)
    grid.parallel.tensor.degree, grid.parallel.tensor.mode = 4, "2d"
    (line,) = data_problems(args, grid)[0]
    assert line.startswith("--packing: a 2D tensor plan does not carry the packed rows' position_ids")
