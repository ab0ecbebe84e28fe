"""Layered accumulation with dropout in checkpointed blocks (one process, world 1).

The micro-batch threads share torch's global random generator, so the order of the forwards decides
which dropout mask each gets, and a checkpointed block's recomputation (alone, in backward) must
draw the same numbers as its forward did. The engine runs a checkpointed block whole for one
micro-batch before handing over (it yields before the block's checkpoint saves the RNG state), so
the masks are those of a plain-PyTorch loop in the same layer-major order: embeddings of every
micro-batch, then block 0 of every micro-batch, block 1, ... Gradients must match that loop.
Yielding inside a checkpointed block would let another micro-batch draw between the saved state
and the block's own draws, and the recomputed masks (hence the gradients) would differ.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import elixir_tune
from tests.distributed.engine_plans import VOCAB, make_plan

DIM, BLOCKS, ACCUM = 16, 3, 3


class DropBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 2 * DIM)
        self.out = nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(self.out(F.gelu(self.fc(self.norm(x)))))


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([DropBlock() for _ in range(BLOCKS)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def loss_of(logits, batch):
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))


@pytest.mark.parametrize("checkpoint_every", [0, 1])
def test_dropout_masks_follow_the_layer_major_order(checkpoint_every):
    torch.manual_seed(0)
    model = DropNet().train()
    reference = copy.deepcopy(model)
    plan = make_plan(
        model, 1, 1024, cache="min", checkpoint_every=checkpoint_every, block_list="blocks", grad_accum_steps=ACCUM
    )
    plan.training.accumulation = "layered"
    wrapped, optimizer = elixir_tune.setup(model, torch.optim.SGD(model.parameters(), lr=0.5), plan=plan)
    generator = torch.Generator().manual_seed(1)
    micro = [{"input_ids": torch.randint(0, VOCAB, (2, 8), generator=generator)} for _ in range(ACCUM)]
    for batch in micro:
        batch["labels"] = batch["input_ids"]

    torch.manual_seed(123)
    loss = wrapped.forward_backward(micro, loss_fn=loss_of)
    optimizer.step()

    # Plain PyTorch, the same order of random draws: layer by layer over the micro-batches.
    torch.manual_seed(123)
    hidden = [reference.emb(batch["input_ids"]) for batch in micro]
    for block in reference.blocks:
        hidden = [block(h) for h in hidden]
    losses = [loss_of(reference.head(h), batch) for h, batch in zip(hidden, micro, strict=True)]
    (sum(losses) / ACCUM).backward()
    with torch.no_grad():
        for param in reference.parameters():
            param -= 0.5 * param.grad

    assert float(loss) == pytest.approx(float(sum(losses).detach()) / ACCUM, rel=1e-6)
    state = wrapped.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
