"""Ring attention's blockwise math in one process (a context group of one: the two chunks of the
load-balanced split, merged by log-sum-exp) against dense attention, forward and backward, and its
refusal of attention dropout. The ring itself runs in tests/distributed/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch

from elixir_tune.engine.comm import Comm
from elixir_tune.engine.parallel.context_parallel import _Exchange
from elixir_tune.engine.parallel.ring_attention import RingSpec, ring_attention

ONE = Comm(0, 1, "local", torch.device("cpu"))
BATCH, HEADS, KV_HEADS, LENGTH, DIM = 2, 4, 2, 12, 8


def _dense(query, key, value, padding, scaling, softcap, window):
    """Transformers' eager attention on the whole sequence (grouped key/value heads repeated)."""
    key, value = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (key, value))
    scores = query @ key.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(LENGTH)
    allowed = positions[None, :] <= positions[:, None]
    if window is not None:
        allowed = allowed & (positions[None, :] > positions[:, None] - window)
    allowed = allowed[None, None] & padding[:, None, None, :]
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return (scores.softmax(-1) @ value).transpose(1, 2)


@pytest.mark.parametrize(("softcap", "window"), [(None, None), (2.0, None), (None, 3), (1.5, 5)])
def test_blockwise_attention_matches_dense_forward_and_backward(softcap, window):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(BATCH, HEADS, LENGTH, DIM, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(BATCH, KV_HEADS, LENGTH, DIM, generator=generator, dtype=torch.float64) for _ in "kv")
    padding = torch.ones(BATCH, LENGTH, dtype=torch.bool)
    # Right padding; every padded query still sees a real key in its window (one that sees none attends
    # uniformly over the keys its blocks hold, not over all of them as dense attention does; its label is
    # -100, so training is the same).
    padding[1, 10:] = False
    grad = torch.randn(BATCH, LENGTH, HEADS, DIM, generator=generator, dtype=torch.float64)
    ours_in = [t.clone().requires_grad_() for t in (query, key, value)]
    dense_in = [t.clone().requires_grad_() for t in (query, key, value)]
    spec = RingSpec(ONE, LENGTH, padding, 0.3, softcap, window)
    ours = ring_attention(spec, *ours_in)
    dense = _dense(*dense_in, padding, 0.3, softcap, window)
    (ours * grad).sum().backward()
    (dense * grad).sum().backward()
    # Scores and the softmax run in float32 inside (as transformers' eager upcast): float32 tolerances.
    torch.testing.assert_close(ours, dense, rtol=0, atol=2e-6)
    for mine, theirs in zip(ours_in, dense_in, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=2e-6)


def test_attention_dropout_is_refused():
    exchange = _Exchange(ONE, "ring", "sdpa", None, LENGTH)
    states = torch.zeros(1, 2, LENGTH, DIM)
    with pytest.raises(ValueError, match="mode ring runs attention without dropout.*use mode allgather"):
        exchange.attend(torch.nn.Module(), states, states, states, {"dropout": 0.1, "scaling": 0.3})
