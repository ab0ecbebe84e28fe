"""A DDP training script written the way nanoGPT's train.py is (our own code, in its style).

Rank 0 alone evaluates (``estimate_loss`` under ``torch.no_grad()``) and saves ``raw_model.state_dict()``
with the optimizer's state, which ``--init_from=resume`` loads before the wrap; every rank clips with ``torch.nn.utils.clip_grad_norm_``, sets the
learning rate in ``optimizer.param_groups`` and accumulates gradients over micro-steps. The drop-in
test ports it to elixir-run by changing two lines (the DDP import and the DDP wrap) and compares.
Options as nanoGPT's configurator takes them: ``--key=value``. Rank 0 writes ``record.json``.
"""

import json
import math
import os
import sys

import numpy as np
import torch
from nanogpt_model import GPT, GPTConfig
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

out_dir = "out"
init_from = "scratch"  # or "resume": from out_dir/ckpt.pt, as nanoGPT resumes
eval_interval = 5
eval_iters = 3
always_save_checkpoint = True
gradient_accumulation_steps = 2
batch_size = 4
block_size = 32
learning_rate = 3e-3
max_iters = 20
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 0.05
decay_lr = 1
warmup_iters = 4
lr_decay_iters = 20
min_lr = 3e-4
backend = "gloo"
for arg in sys.argv[1:]:
    key, value = arg.removeprefix("--").split("=")
    globals()[key] = type(globals()[key])(value)

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
else:
    master_process, seed_offset = True, 0
if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)

# nanoGPT memory-maps train.bin and val.bin; a fixed, learnable token stream stands in for them.
stream = np.random.default_rng(0)
train_data = ((np.arange(20000) * 7 + stream.integers(0, 3, 20000)) % 96).astype(np.uint16)
val_data = ((np.arange(4000) * 7 + stream.integers(0, 3, 4000)) % 96).astype(np.uint16)


def get_batch(split):
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
    return x, y


iter_num = 0
best_val_loss = 1e9
model_args = dict(n_layer=2, n_head=2, n_embd=32, block_size=block_size, bias=True, vocab_size=96, dropout=0.0)
checkpoint = None
if init_from == "resume":
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu", weights_only=False)
    model_args, iter_num, best_val_loss = checkpoint["model_args"], checkpoint["iter_num"], checkpoint["best_val_loss"]
model = GPT(GPTConfig(**model_args))
if checkpoint is not None:
    model.load_state_dict(checkpoint["model"])
scaler = torch.amp.GradScaler("cpu", enabled=False)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), "cpu")
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint["optimizer"])
checkpoint = None
if ddp:
    model = DDP(model)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


X, Y = get_batch("train")
raw_model = model.module if ddp else model
record = {"losses": [], "evals": []}
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        record["evals"].append([iter_num, float(losses["train"]), float(losses["val"])])
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                checkpoint = {
                    "model": raw_model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "model_args": model_args,
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                }
                torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    lossf = loss.item() * gradient_accumulation_steps
    if master_process:
        record["losses"].append(lossf)
        print(f"iter {iter_num}: loss {lossf:.4f}")
    iter_num += 1
    if iter_num > max_iters:
        break
if master_process:
    with open(os.path.join(out_dir, "record.json"), "w") as file:
        json.dump(record, file)
if ddp:
    torch.distributed.barrier()  # both ranks end together: gloo can abort a rank that tears down alone
    destroy_process_group()
