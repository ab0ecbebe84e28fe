"""Token-weighted micro-batch losses at world 1 (engine/token_weights.py): the weights, when they
apply, and the unmasked step unchanged to the bit. The multi-rank comparison with plain PyTorch is
tests/distributed/test_token_weights.py."""

from __future__ import annotations

import pytest
import torch

import elixir_tune
from elixir_tune.engine.token_weights import counted_tokens, is_causal_lm, wants_token_weights
from tests.distributed.engine_plans import batches, make_plan, tiny_gpt2

MICRO = 2
ACCUM = 2


def set_up():
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = make_plan(model, 1, 4096, block_list="transformer.h", grad_accum_steps=ACCUM)
    return elixir_tune.setup(model, opt, plan=plan)


def split(batch: dict) -> list[dict]:
    return [{k: v[i * MICRO : (i + 1) * MICRO] for k, v in batch.items()} for i in range(ACCUM)]


def test_counted_tokens_are_the_shifted_labels_that_are_not_ignored():
    labels = torch.tensor([[-100, -100, 5, 6], [1, 2, -100, 3]])
    assert int(counted_tokens({"labels": labels})) == 2 + 2  # position 0 predicts nothing
    assert counted_tokens({"input_ids": labels}) is None
    assert counted_tokens({"labels": torch.tensor([1, 0])}) is None  # a classifier's labels: no tokens
    assert int(counted_tokens({"labels": labels}, shift=False)) == 2 + 3  # a masked LM's: every label counts


def test_only_causal_lms_are_weighted_by_default():
    from transformers import GPT2Config, GPT2LMHeadModel, RobertaConfig, RobertaForMaskedLM

    tiny = {"n_embd": 8, "n_layer": 1, "n_head": 2, "vocab_size": 16, "n_positions": 8}
    assert is_causal_lm(GPT2LMHeadModel(GPT2Config(**tiny)))
    masked = RobertaForMaskedLM(
        RobertaConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8, vocab_size=16)
    )
    assert not is_causal_lm(masked)
    with_labels = [{"labels": torch.zeros(2, 4, dtype=torch.long)}] * 2
    assert not wants_token_weights(with_labels, None, has_loss_fn=False, causal_lm=False)
    assert wants_token_weights(with_labels, True, has_loss_fn=False, causal_lm=False)


def test_the_default_weighs_the_models_own_loss_only():
    with_labels = [{"labels": torch.zeros(2, 4, dtype=torch.long)}] * 2
    assert wants_token_weights(with_labels, None, has_loss_fn=False)
    assert not wants_token_weights(with_labels, None, has_loss_fn=True)  # a loss_fn's normalization is its own
    assert wants_token_weights(with_labels, True, has_loss_fn=True)
    assert not wants_token_weights(with_labels, False, has_loss_fn=False)
    assert not wants_token_weights([{"input_ids": torch.zeros(2, 4)}], None, has_loss_fn=False)
    with pytest.raises(ValueError, match=r"micro-batches \[1\] have no labels.*weight_by_tokens=False"):
        wants_token_weights([with_labels[0], {"input_ids": torch.zeros(2, 4)}], True, has_loss_fn=False)


def test_uneven_masks_weigh_each_micro_batch_by_its_tokens():
    model, _ = set_up()
    micro = split(batches(1, MICRO * ACCUM, 8)[0])
    micro[0]["labels"][:, :6] = -100  # 2 rows x 2 counted tokens; the other micro-batch 2 x 7
    assert model.token_weights(micro) == [4 / 18, 14 / 18]
    with torch.no_grad():
        whole = float(model(**{k: torch.cat([m[k] for m in micro]) for k in micro[0]}).loss)
    # The step's loss is the whole batch's, not the mean of the micro-batch means.
    assert float(model.forward_backward(micro)) == pytest.approx(whole, rel=1e-6)
    unweighted = float(model.forward_backward(micro, weight_by_tokens=False))
    assert abs(unweighted - whole) > 1e-3


def test_unmasked_steps_are_bitwise_the_plain_mean():
    steps = batches(3, MICRO * ACCUM, 8)
    runs = []
    for weight_by_tokens in (None, False):
        model, opt = set_up()
        assert model.token_weights(split(steps[0])) == [1 / ACCUM] * ACCUM
        losses = []
        for batch in steps:
            losses.append(model.forward_backward(split(batch), weight_by_tokens=weight_by_tokens))
            opt.step()
            opt.zero_grad()
        runs.append((torch.stack(losses), [chunk.master.clone() for chunk in model.engine.chunks]))
    (losses_a, masters_a), (losses_b, masters_b) = runs
    assert torch.equal(losses_a, losses_b)
    assert all(torch.equal(a, b) for a, b in zip(masters_a, masters_b, strict=True))
