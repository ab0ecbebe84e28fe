"""A DDP fine-tuning loop written the way Hugging Face's examples write one (our own code, in their style).

The learning-rate scheduler (cosine with warm-up, transformers' own) is built on the optimizer
before the model is wrapped, gradients accumulate over ``--accum`` micro-batches, torch's
``clip_grad_norm_`` clips them, and ``model.zero_grad()`` clears them. The drop-in test ports it to
elixir-run by changing the DDP import and the DDP wrap. Rank 0 writes ``record.json``.
Options: ``--out DIR --steps N --accum K --model configs/models/gpt2-tiny.yaml``.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import get_cosine_schedule_with_warmup

from elixir_tune.profiler import load_model_source

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--model", required=True)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--accum", type=int, default=2)
parser.add_argument("--micro-batch", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=32)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = load_model_source(args.model).build_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01, eps=1e-6)
scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=args.steps)
model = DDP(model)

# The whole dataset on every rank; each rank takes every world-th sample (DistributedSampler's split).
generator = torch.Generator().manual_seed(1)
samples = args.steps * args.accum * args.micro_batch * world
tokens = torch.randint(0, 200, (samples, args.seq_len), generator=generator)
mine = tokens[rank::world]
record = {"losses": [], "lrs": [], "norms": []}
model.train()
for step in range(args.steps):
    for micro in range(args.accum):
        index = (step * args.accum + micro) * args.micro_batch
        batch = mine[index : index + args.micro_batch]
        outputs = model(input_ids=batch, labels=batch)
        loss = outputs.loss / args.accum
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    scheduler.step()
    model.zero_grad()
    summed = loss.detach() * args.accum
    dist.all_reduce(summed)
    record["losses"].append(float(summed) / world)
    record["lrs"].append(scheduler.get_last_lr()[0])
    record["norms"].append(float(norm))
if rank == 0:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "record.json"), "w") as file:
        json.dump(record, file)
dist.barrier()  # both ranks end together (gloo's teardown)
dist.destroy_process_group()
