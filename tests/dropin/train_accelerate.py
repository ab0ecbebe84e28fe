"""A plain accelerate loop as its documentation writes it, with nothing of elixir-tune in it: ``prepare``,
``accumulate``, ``backward``, ``clip_grad_norm_``, a scheduler, then the documented final save
(``wait_for_everyone``, ``unwrap_model(model).save_pretrained(...)`` with accelerate's save function)
and ``accelerator.save_model``. Rank 0 writes its losses to ``OUT/losses.json``. Usage: ``train_accelerate.py OUT``."""

import json
import os
import sys

import torch
from accelerate import Accelerator
from tiny_llama_model import build_model, token_rows
from torch.utils.data import DataLoader

out = sys.argv[1]
accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
torch.manual_seed(0)
model = build_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
loader = DataLoader(torch.tensor(token_rows()), batch_size=4, shuffle=False)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
losses = []
for tokens in loader:
    with accelerator.accumulate(model):
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    losses.append(accelerator.gather(loss.detach()).mean().item())
accelerator.wait_for_everyone()
unwrapped = accelerator.unwrap_model(model)
unwrapped.save_pretrained(out, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
accelerator.save_model(model, os.path.join(out, "save_model"))
if accelerator.is_main_process:
    with open(os.path.join(out, "losses.json"), "w") as file:
        json.dump(losses, file)
