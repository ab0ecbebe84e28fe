"""elixir_tune.data: samples into batches: text modes, masking, padding, packing, rank shares, epochs, eval."""

from __future__ import annotations

import json

import pytest
import torch

from elixir_tune.data import DataSpec, block_causal_mask, load_data
from elixir_tune.data.chat import encode_messages
from elixir_tune.data.packing import best_fit_bins
from elixir_tune.data.sampling import split_eval
from tests.fixtures.tiny_hf import CHAT_TEMPLATE, CONVERSATIONS, PROMPT_COMPLETIONS, train_tokenizer, write_formats


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_formats(tmp_path_factory.mktemp("batches"))


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def test_text_modes_cut_the_text_as_described(files, tokenizer):
    text = files["txt"].read_text()
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    lines = [line for line in text.splitlines() if line.strip()]
    assert load_data(DataSpec(str(files["txt"]), text_mode="document"), tokenizer, 64).num_samples() == 1
    assert load_data(DataSpec(str(files["txt"]), text_mode="paragraph"), tokenizer, 64).num_samples() == len(paragraphs)
    assert load_data(DataSpec(str(files["txt"]), text_mode="line"), tokenizer, 64).num_samples() == len(lines)
    # pack: every document's tokens, then EOS, in one stream cut into full windows
    packed = load_data(DataSpec(str(files["txt"]), text_mode="pack"), tokenizer, 64)
    stream = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    assert packed.num_samples() == len(stream) // 64
    windows = [packed.train.encode(i)[0] for i in range(packed.num_samples())]
    assert sum(windows, []) == stream[: 64 * packed.num_samples()]
    rows = packed.batch(0, packed.num_samples(), 0, 1)
    assert bool((rows["attention_mask"] == 1).all()) and torch.equal(rows["labels"], rows["input_ids"])
    # the records of a text field are the documents, each ended with EOS
    records = load_data(DataSpec(str(files["text_jsonl"]), text_mode="pack"), tokenizer, 64)
    joined = sum((tokenizer(p)["input_ids"] + [tokenizer.eos_token_id] for p in paragraphs), [])
    assert (
        sum((records.train.encode(i)[0] for i in range(records.num_samples())), [])
        == joined[: 64 * records.num_samples()]
    )


def test_without_a_tokenizer_the_bytes_are_the_tokens(files):
    data = load_data(DataSpec(str(files["txt"]), text_mode="paragraph"), None, 4096)
    first = files["txt"].read_text().split("\n\n")[0].strip()
    assert data.train.encode(0)[0] == list(first.encode())


def test_truncation_and_right_padding(files, tokenizer):
    data = load_data(DataSpec(str(files["txt"]), text_mode="paragraph"), tokenizer, 16)
    lengths = [len(data.train.encode(i)[0]) for i in range(data.num_samples())]
    assert f"{sum(n > 16 for n in lengths)} truncated to 16" in data.describe()
    short = load_data(DataSpec(str(files["prompt_completion_jsonl"])), tokenizer, 64)
    batch = short.batch(0, 6, 0, 1)
    for row in range(6):
        length = int(batch["attention_mask"][row].sum())
        assert bool((batch["attention_mask"][row, :length] == 1).all())
        assert bool((batch["input_ids"][row, length:] == tokenizer.pad_token_id).all())
        assert bool((batch["labels"][row, length:] == -100).all())


def test_describe_counts_the_tokens_the_loss_predicts(files, tokenizer):
    data = load_data(DataSpec(str(files["messages_jsonl"])), tokenizer, 64)
    batch = data.batch(0, data.num_samples(), 0, 1)
    tokens = int(batch["attention_mask"].sum())
    predicted = int((batch["labels"][:, 1:] != -100).sum())
    assert f"{tokens:,} tokens ({predicted:,} with loss), 0 truncated to 64" in data.describe()


def test_prompt_tokens_have_no_labels_and_the_completion_ends_with_eos(tokenizer):
    from elixir_tune.data.prompt_completion import encode_prompt_completion

    prompt, completion = PROMPT_COMPLETIONS[0]
    ids, labels = encode_prompt_completion(tokenizer, prompt, completion)
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert labels[: len(prompt_ids)] == [-100] * len(prompt_ids)
    assert tokenizer.decode(labels[len(prompt_ids) : -1]) == completion
    assert labels[-1] == ids[-1] == tokenizer.eos_token_id


def test_assistant_turns_are_found_with_and_without_generation_markers(tokenizer):
    plain = train_tokenizer()
    plain.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    for conversation in CONVERSATIONS:
        marked = encode_messages(tokenizer, conversation)
        assert encode_messages(plain, conversation) == marked
        learned = tokenizer.decode([label for label in marked[1] if label != -100])
        expected = "".join(m["content"] + "<|end|>\n" for m in conversation if m["role"] == "assistant")
        assert learned == expected


def spy_on_encoding(data):
    """The sample indices ``data`` encodes (tokenizes) from now on."""
    seen: list[int] = []
    encode = data.train.encode

    def spying(index):
        seen.append(index)
        return encode(index)

    data.train.encode = spying
    return seen


def test_each_rank_reads_and_tokenizes_only_its_slice_of_the_global_batch(files, tokenizer):
    spec = DataSpec(str(files["txt"]), text_mode="line", seed=3)
    whole = load_data(spec, tokenizer, 32)
    ranks = [load_data(spec, tokenizer, 32) for _ in range(4)]
    seen = [spy_on_encoding(data) for data in ranks]
    for step in range(3):
        expected = whole.batch(step, 8, 0, 1)
        parts = []
        for rank, data in enumerate(ranks):
            seen[rank].clear()
            parts.append(data.batch(step, 8, rank, 4))
            picks = [data._order.sample_at(p) for p in range(step * 8 + rank * 2, step * 8 + rank * 2 + 2)]
            assert sorted(set(seen[rank])) == sorted(set(picks))  # its two rows, nothing else
        for key in expected:
            assert torch.equal(torch.cat([part[key] for part in parts]), expected[key])


def test_epochs_visit_every_sample_once_in_a_new_order(files, tokenizer):
    data = load_data(DataSpec(str(files["txt"]), text_mode="line", seed=1), tokenizer, 64)
    count = data.num_samples()
    order = [data._order.sample_at(position) for position in range(3 * count)]
    epochs = [order[i * count : (i + 1) * count] for i in range(3)]
    assert all(sorted(epoch) == list(range(count)) for epoch in epochs)
    assert epochs[0] != epochs[1]
    assert data.epoch(step=3, global_batch_size=count) == 3.0
    assert data.epoch(step=1, global_batch_size=5) == pytest.approx(5 / count)
    again = load_data(DataSpec(str(files["txt"]), text_mode="line", seed=1), tokenizer, 64)
    assert torch.equal(again.batch(5, 4, 0, 1)["input_ids"], data.batch(5, 4, 0, 1)["input_ids"])


def test_the_eval_split_is_held_out_by_seed_and_read_in_order(files, tokenizer):
    train, held_out = split_eval(20, 0.25, seed=7)
    assert len(held_out) == 5 and sorted(train + held_out) == list(range(20))
    assert split_eval(20, 0.25, seed=7) == (train, held_out) and split_eval(20, 0.25, seed=8) != (train, held_out)
    spec = DataSpec(str(files["txt"]), text_mode="line", eval_fraction=0.25, seed=7)
    data = load_data(spec, tokenizer, 64)
    whole = load_data(DataSpec(str(files["txt"]), text_mode="line"), tokenizer, 64)
    total = whole.num_samples()
    assert data.num_samples() + len(data.eval) == total
    batches = list(data.eval_batches(3))
    assert [len(b["input_ids"]) for b in batches][:-1] == [3] * (len(batches) - 1)
    eval_rows = torch.cat([b["input_ids"] for b in batches])
    _, chosen = split_eval(total, 0.25, 7)
    expected = whole.train.subset(chosen)
    assert [row[row != tokenizer.pad_token_id].tolist() for row in eval_rows] == [
        expected.encode(i)[0] for i in range(len(chosen))
    ]
    assert load_data(DataSpec(str(files["txt"]), text_mode="line"), tokenizer, 64).eval_batches(4) is None


def test_eval_shares_cover_the_split_once_with_equal_batches_on_every_rank(files, tokenizer):
    data = load_data(DataSpec(str(files["txt"]), text_mode="line", eval_fraction=0.3), tokenizer, 64)
    assert len(data.eval) % 3 != 0  # so that the last share needs blank rows
    whole = torch.cat([b["input_ids"] for b in data.eval_batches(4)])
    shares = [list(data.eval_batches(4, rank, 3)) for rank in range(3)]
    assert len({len(batches) for batches in shares}) == 1
    assert len({tuple(len(b["input_ids"]) for b in batches) for batches in shares}) == 1
    rows = torch.cat([b["input_ids"] for batches in shares for b in batches])
    labels = torch.cat([b["labels"] for batches in shares for b in batches])
    real = rows[: len(whole)]
    assert torch.equal(real, whole)
    assert bool((labels[len(whole) :] == -100).all()) and bool((rows[len(whole) :] == tokenizer.pad_token_id).all())


def test_an_eval_file_must_have_the_training_format(files, tokenizer, tmp_path):
    spec = DataSpec(str(files["prompt_completion_jsonl"]), eval_path=str(files["prompt_completion_csv"]))
    data = load_data(spec, tokenizer, 64)
    assert len(data.eval) == 6 and "eval: 6 samples" in data.describe()
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"text": "a"}) + "\n")
    from elixir_tune.data import DataError

    with pytest.raises(DataError, match="format prompt_completion needs the fields prompt, completion"):
        load_data(DataSpec(str(files["prompt_completion_jsonl"]), eval_path=str(other)), tokenizer, 64)


def test_best_fit_puts_every_sample_in_exactly_one_row_that_fits():
    lengths = [int(n) for n in torch.randint(1, 33, (200,), generator=torch.Generator().manual_seed(0))]
    rows = best_fit_bins(lengths, 32)
    assert sorted(i for row in rows for i in row) == list(range(200))
    assert all(sum(lengths[i] for i in row) <= 32 for row in rows)
    assert len(rows) <= sum(lengths) / 32 * 1.25  # within a quarter of the bound (best fit is near it)


def test_packed_rows_restart_positions_and_keep_labels_per_sample(files, tokenizer):
    data = load_data(DataSpec(str(files["prompt_completion_jsonl"]), packing=True), tokenizer, 64)
    assert data.packed and data.num_samples() < 6 and "packed into" in data.describe()
    batch = data.batch(0, data.num_samples(), 0, 1)
    assert "attention_mask" not in batch and set(batch) == {"input_ids", "labels", "position_ids"}
    placed = 0
    for row, members in zip(
        range(len(data.rows)), [data.rows[data._order.sample_at(p)] for p in range(len(data.rows))], strict=True
    ):
        start = 0
        for index in members:
            ids, labels = data.train.encode(index)
            end = start + len(ids)
            assert batch["input_ids"][row, start:end].tolist() == ids
            assert batch["position_ids"][row, start:end].tolist() == list(range(len(ids)))
            # the first token's label is dropped: it would be predicted from the previous sample
            assert batch["labels"][row, start:end].tolist() == [-100] + labels[1:]
            start, placed = end, placed + 1
        assert bool((batch["labels"][row, start:] == -100).all())
    assert placed == 6


def test_the_block_causal_mask_lets_tokens_see_only_their_own_sample():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    allowed = block_causal_mask(positions, torch.float32)[0, 0] == 0
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)
