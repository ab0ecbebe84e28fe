"""elixir_tune.data with a real tiny Hugging Face Llama: the masked losses equal a plain PyTorch computation
of the same loss, and a packed row gives each sample the losses it has alone."""

from __future__ import annotations

import pytest
import torch

from elixir_tune.data import DataSpec, block_causal_mask, load_data
from tests.fixtures.tiny_hf import CONVERSATIONS, PROMPT_COMPLETIONS, make_llama_dir, write_formats


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("llama")
    model_dir = make_llama_dir(root / "model")
    return model_dir, AutoTokenizer.from_pretrained(model_dir), write_formats(root / "data")


def load_model(model_dir, attention="sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attention, dtype=torch.float32).eval()


def token_losses(model, ids: list[int]) -> torch.Tensor:
    """-log p(ids[t] | ids[:t]) for t = 1.., the sequence run alone and unpadded."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none")


def test_completion_only_loss_equals_plain_pytorch(llama):
    model_dir, tokenizer, files = llama
    model = load_model(model_dir)
    data = load_data(DataSpec(str(files["prompt_completion_jsonl"])), tokenizer, 64)
    batch = data.batch(0, len(PROMPT_COMPLETIONS), 0, 1)
    with torch.no_grad():
        loss = model(**batch).loss
    # independently: the completion's tokens (and EOS) are those after the prompt's, by construction
    total, count = 0.0, 0
    for prompt, completion in PROMPT_COMPLETIONS:
        prompt_ids = tokenizer(prompt)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = prompt_ids + completion_ids
        assert any(row[: len(ids)].tolist() == ids for row in batch["input_ids"])
        losses = token_losses(model, ids)[len(prompt_ids) - 1 :]  # predictions of the completion's tokens
        assert len(losses) == len(completion_ids)
        total, count = total + float(losses.double().sum()), count + len(losses)
    assert float(loss) == pytest.approx(total / count, rel=1e-6, abs=1e-6)


def assistant_token_positions(tokenizer, conversation) -> tuple[list[int], list[int]]:
    """The rendered conversation's tokens and the positions of the assistant's, found from the strings."""
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    spans, cursor = [], 0
    for message in conversation:
        if message["role"] == "assistant":
            turn = "<|assistant|>\n" + message["content"] + "<|end|>\n"
            start = rendered.index(turn, cursor) + len("<|assistant|>\n")
            cursor = start + len(message["content"]) + len("<|end|>\n")
            spans.append((start, cursor))
    encoded = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    positions = [t for t, (start, _) in enumerate(encoded["offset_mapping"]) if any(a <= start < b for a, b in spans)]
    return list(encoded["input_ids"]), positions


def test_assistant_only_loss_equals_plain_pytorch(llama):
    model_dir, tokenizer, files = llama
    model = load_model(model_dir)
    data = load_data(DataSpec(str(files["messages_jsonl"])), tokenizer, 64)
    batch = data.batch(0, len(CONVERSATIONS), 0, 1)
    with torch.no_grad():
        loss = model(**batch).loss
    total, count = 0.0, 0
    for conversation in CONVERSATIONS:
        ids, positions = assistant_token_positions(tokenizer, conversation)
        assert any(row[: len(ids)].tolist() == ids for row in batch["input_ids"])
        losses = token_losses(model, ids)
        chosen = losses[torch.tensor(positions) - 1]  # the loss at t predicts token t + 1
        total, count = total + float(chosen.double().sum()), count + len(positions)
    assert count > 0 and (batch["labels"] != -100).sum() == count
    assert float(loss) == pytest.approx(total / count, rel=1e-6, abs=1e-6)


def packed_losses(model, data, batch, **inputs) -> torch.Tensor:
    """Per-token losses of the packed rows, where the labels are not -100, row by row."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], use_cache=False, **inputs).logits
    labels = batch["labels"][:, 1:]
    keep = labels != -100
    return torch.nn.functional.cross_entropy(logits[:, :-1][keep], labels[keep], reduction="none")


def alone_losses(model, data, rows: int) -> torch.Tensor:
    """Per-token losses of the same samples, each run alone, in the order they sit in the rows."""
    losses = []
    for row in range(rows):
        for index in data.rows[data._order.sample_at(row)]:
            ids, labels = data.train.encode(index)
            losses.append(token_losses(model, ids)[torch.tensor(labels[1:]) != -100])
    return torch.cat(losses)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_row_gives_each_sample_its_losses_alone(llama, attention):
    model_dir, tokenizer, files = llama
    model = load_model(model_dir, attention)
    data = load_data(DataSpec(str(files["prompt_completion_jsonl"]), packing=True), tokenizer, 64)
    batch = data.batch(0, data.num_samples(), 0, 1)
    assert any(len(row) > 1 for row in data.rows)
    alone = alone_losses(model, data, data.num_samples())
    # transformers builds the block-diagonal mask from the restarting position_ids (with no key/value
    # cache, as in training: the engine turns it off)
    packed = packed_losses(model, data, batch, position_ids=batch["position_ids"])
    assert torch.allclose(packed, alone, rtol=1e-5, atol=1e-5)
    # the same with the 4D mask passed explicitly
    mask = block_causal_mask(batch["position_ids"], torch.float32)
    explicit = packed_losses(model, data, batch, position_ids=batch["position_ids"], attention_mask=mask)
    assert torch.allclose(explicit, alone, rtol=1e-5, atol=1e-5)
    # and the check can fail: with a plain 2D mask the samples attend to each other
    ones = torch.ones_like(batch["input_ids"])
    leaky = packed_losses(model, data, batch, position_ids=batch["position_ids"], attention_mask=ones)
    assert not torch.allclose(leaky, alone, rtol=1e-3, atol=1e-3)


def test_eval_shares_sum_to_the_whole_split_and_blank_rows_stay_finite(llama):
    model_dir, tokenizer, files = llama
    model = load_model(model_dir)
    data = load_data(DataSpec(str(files["prompt_completion_jsonl"]), eval_fraction=0.5), tokenizer, 64)

    def summed(batches) -> tuple[float, int]:
        total, count = 0.0, 0
        for batch in batches:
            tokens = int((batch["labels"][:, 1:] != -100).sum())
            with torch.no_grad():
                output = model(**batch, use_cache=False)
            assert bool(torch.isfinite(output.logits).all())
            if tokens:
                total, count = total + float(output.loss) * tokens, count + tokens
        return total, count

    whole_total, whole_count = summed(data.eval_batches(2))
    shares = [summed(data.eval_batches(2, rank, 2)) for rank in range(2)]
    assert len(data.eval) == 3 and sum(count for _, count in shares) == whole_count
    assert sum(total for total, _ in shares) / whole_count == pytest.approx(whole_total / whole_count, rel=1e-6)
