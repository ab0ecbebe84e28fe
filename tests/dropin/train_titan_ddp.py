"""Two DDP loops in one script, each on a fresh model: one written the way torchtitan's train loop is
(our own code, in its style: the loss outside the model, ``clip_grad_norm_(..., foreach=True)``, a
linear warm-up ``LambdaLR`` built before the model is wrapped, ``optimizer.zero_grad()``), and a
minimal one (the model returns the loss as a bare scalar). The drop-in test ports it by changing
the DDP import and the DDP wrap. Rank 0 writes ``record.json``. Options: ``--out DIR --steps N``.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from titan_model import VOCAB, Transformer
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
generator = torch.Generator().manual_seed(rank)
batches = [torch.randint(0, VOCAB, (4, 32), generator=generator) for _ in range(args.steps)]


def wrap(model, optimizer):
    model = DDP(model)
    return model, optimizer


def titan_loop():
    torch.manual_seed(0)
    model = Transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    model, optimizer = wrap(model, optimizer)
    losses = []
    for tokens in batches:
        optimizer.zero_grad()
        pred = model(tokens[:, :-1])
        loss = F.cross_entropy(pred.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3, foreach=True)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def minimal_loop():
    torch.manual_seed(1)
    model = Transformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = wrap(model, optimizer)
    losses = []
    for tokens in batches:
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


record = {"titan": titan_loop(), "minimal": minimal_loop()}
if rank == 0:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "record.json"), "w") as file:
        json.dump(record, file)
dist.barrier()  # both ranks end together (gloo's teardown)
dist.destroy_process_group()
