"""The fine-tuning recipe's start line on padding (issue "What a newcomer meets"): the share of padding in the rows
an epoch computes, and what ``--packing`` would make of it, checked against the rows the data really gives."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from elixir_tune.data import DataSpec, load_data
from elixir_tune.plan import TensorParallel
from elixir_tune.recipes.finetune_options import padding_note
from tests.fixtures.tiny_hf import train_tokenizer, write_formats

SEQ_LEN = 128
DATA_PARALLEL = SimpleNamespace(parallel=SimpleNamespace(tensor=TensorParallel()))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_formats(tmp_path_factory.mktemp("padding"))


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def padding_share(data) -> float:
    """The padding in one epoch of the rows the run computes, counted in the batches themselves."""
    rows = data.batch(0, data.num_samples(), 0, 1)
    if "attention_mask" in rows:
        return float((rows["attention_mask"] == 0).sum()) / rows["input_ids"].numel()
    return float((rows["input_ids"] == data.pad_id).sum()) / rows["input_ids"].numel()  # no sample holds <pad>


@pytest.mark.parametrize("name", ["messages_jsonl", "prompt_completion_jsonl"])
def test_short_samples_are_told_their_padding_and_what_packing_would_leave(files, tokenizer, name):
    spec = DataSpec(str(files[name]))
    padded = load_data(spec, tokenizer, SEQ_LEN)
    packed = load_data(dataclasses.replace(spec, packing=True), tokenizer, SEQ_LEN)
    samples, packed_rows = padded.num_samples(), packed.num_samples()
    assert packed_rows < samples and padding_share(padded) > 0.5 > padding_share(packed)

    assert padding_note(padded, DATA_PARALLEL) == (
        f"rows are padded to {SEQ_LEN} tokens: {padding_share(padded):.0%} of the tokens computed are padding; "
        f"--packing would pack the {samples} samples into {packed_rows} rows ({padding_share(packed):.0%} padding)"
    )
    assert padding_note(packed, DATA_PARALLEL) == (
        f"rows: {samples} samples packed into {packed_rows} rows of {SEQ_LEN} tokens: "
        f"{padding_share(packed):.0%} of the tokens computed are padding"
    )
    two_d = SimpleNamespace(parallel=SimpleNamespace(tensor=TensorParallel(degree=4, mode="2d")))
    assert padding_note(padded, two_d).endswith("padding) under a data-parallel or 1D tensor plan")


def test_rows_that_packing_cannot_shorten_get_no_packing_advice(files, tokenizer):
    truncated = load_data(DataSpec(str(files["messages_jsonl"])), tokenizer, 8)  # every chat is longer than 8
    assert (
        padding_note(truncated, DATA_PARALLEL) == "rows are padded to 8 tokens: 0% of the tokens computed are padding"
    )


def test_text_cut_into_full_windows_has_no_padding_to_report(files, tokenizer):
    assert padding_note(load_data(DataSpec(str(files["txt"])), tokenizer, SEQ_LEN), DATA_PARALLEL) is None
    lines = load_data(DataSpec(str(files["txt"]), text_mode="paragraph"), tokenizer, SEQ_LEN)
    assert padding_note(lines, DATA_PARALLEL).startswith(f"rows are padded to {SEQ_LEN} tokens: ")
