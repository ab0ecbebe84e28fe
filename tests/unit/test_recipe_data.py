"""The recipes' text data and run length: each data rank's rows are its slice of the global batch, an epoch visits
every sample once, ``--epochs`` gives the step count, and bad option values are one line each."""

from __future__ import annotations

import argparse

import pytest
import torch

from elixir_tune.recipes.finetune import build_parser
from elixir_tune.recipes.loop import lr_at, run_steps
from elixir_tune.recipes.options import OptionsError, parse_options
from elixir_tune.recipes.text_data import ByteWindows, TextPieces, split_off_eval


def pieces(count: int) -> list[list[int]]:
    return [[index + 1] * (2 + index % 3) for index in range(count)]


def test_data_ranks_get_their_slice_of_the_global_batch():
    data = TextPieces(pieces(10), seq_len=6, pad_id=0, seed=4, name="t")
    for step in range(4):
        whole = data.batch(step, 4, 0, 1)
        halves = [data.batch(step, 4, rank, 2) for rank in (0, 1)]
        for key in ("input_ids", "attention_mask", "labels"):
            assert torch.equal(torch.cat([half[key] for half in halves]), whole[key])
    windows = ByteWindows(torch.arange(100) % 256, seq_len=8, seed=1, name="b", eval_tokens=None)
    whole = windows.batch(3, 4, 0, 1)["input_ids"]
    assert torch.equal(torch.cat([windows.batch(3, 4, rank, 2)["input_ids"] for rank in (0, 1)]), whole)


def test_an_epoch_visits_every_sample_once_and_padding_has_no_loss():
    data = TextPieces(pieces(8), seq_len=6, pad_id=0, seed=2, name="t")
    first_epoch = torch.cat([data.batch(step, 4, 0, 1)["input_ids"][:, 0] for step in (0, 1)])
    second_epoch = torch.cat([data.batch(step, 4, 0, 1)["input_ids"][:, 0] for step in (2, 3)])
    assert sorted(first_epoch.tolist()) == list(range(1, 9)) == sorted(second_epoch.tolist())
    assert not torch.equal(first_epoch, second_epoch)  # a new seeded order per epoch
    assert data.epoch(3, 4) == 1.5
    batch = data.batch(0, 4, 0, 1)
    assert torch.equal(batch["labels"] == -100, batch["attention_mask"] == 0)


def test_the_eval_split_is_held_out_and_batched_in_order():
    train, held = split_off_eval(list(range(10)), 0.2, seed=0)
    assert len(held) == 2 and sorted(train + held) == list(range(10)) and not set(train) & set(held)
    data = TextPieces(pieces(8), seq_len=6, pad_id=0, seed=0, name="t", eval_pieces=pieces(5))
    sizes = [batch["input_ids"].shape[0] for batch in data.eval_batches(2) or []]
    assert sizes == [2, 2, 1]
    assert TextPieces(pieces(3), seq_len=6, pad_id=0, seed=0, name="t").eval_batches(2) is None


def test_epochs_give_the_step_count():
    data = TextPieces(pieces(30), seq_len=6, pad_id=0, seed=0, name="t")
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
    ],
)
def test_bad_option_values_are_one_line(argv: list[str], message: str):
    with pytest.raises(OptionsError) as caught:
        parse_options(build_parser(), argv, for_preflight=True)
    assert str(caught.value) == message
