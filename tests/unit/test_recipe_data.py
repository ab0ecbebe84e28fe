"""The recipes' run length and pretrain's byte data: each data rank's rows are its slice of the global batch,
``--epochs`` gives the step count, and bad option values are one line each."""

from __future__ import annotations

import argparse

import pytest
import torch

from elixir_tune.recipes.finetune import build_parser
from elixir_tune.recipes.loop import lr_at, run_steps
from elixir_tune.recipes.options import OptionsError, parse_options
from elixir_tune.recipes.text_data import ByteWindows


def test_data_ranks_get_their_slice_of_the_global_batch():
    """Pretrain's byte windows; the fine-tuning data's own slices are tests/unit/test_data_batches.py's."""
    windows = ByteWindows(torch.arange(100) % 256, seq_len=8, seed=1, name="b", eval_tokens=None)
    whole = windows.batch(3, 4, 0, 1)["input_ids"]
    assert torch.equal(torch.cat([windows.batch(3, 4, rank, 2)["input_ids"] for rank in (0, 1)]), whole)


def test_epochs_give_the_step_count():
    data = ByteWindows(torch.arange(181) % 256, seq_len=6, seed=0, name="b", eval_tokens=None)  # 30 windows
    assert run_steps(argparse.Namespace(epochs=2.0, steps=None), data, 8) == 8  # ceil(60 / 8)
    assert run_steps(argparse.Namespace(epochs=None, steps=5), data, 8) == 5
    assert run_steps(argparse.Namespace(epochs=None, steps=None), data, 8) == 100
    assert lr_at(0, 10, 1.0, 2) == 0.5 and lr_at(10, 10, 1.0, 2) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be 1 or more, not 0"),
        (["--steps", "3", "--epochs", "1"], "argument --epochs: not allowed with argument --steps"),
        (["--epochs", "0"], "--epochs must be above 0, not 0"),
        (["--eval-fraction", "1.5"], "--eval-fraction is a share of the samples, 0 <= F < 1, not 1.5"),
        (["--eval-fraction", "0.1", "--eval-data", "e.txt"], "give --eval-fraction or --eval-data, not both"),
        (
            ["--format", "chat"],
            "argument --format: invalid choice: 'chat' (choose from 'auto', 'text', 'prompt_completion', 'messages')",
        ),
    ],
)
def test_bad_option_values_are_one_line(argv: list[str], message: str):
    with pytest.raises(OptionsError) as caught:
        parse_options(build_parser(), argv, for_preflight=True)
    assert str(caught.value) == message
