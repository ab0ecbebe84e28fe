"""A transformers.Trainer script as its users write it, with nothing of elixir-tune in it: a tiny Llama
from a config, token rows, 20 steps of 4 x 2 accumulation per rank, clipping, a warm-up schedule, then
``trainer.save_model(OUT)``. Rank 0 writes the logged losses to ``OUT/losses.json``. Usage: ``train_trainer.py OUT``."""

import json
import os
import sys

import torch
from tiny_llama_model import build_model, token_rows
from transformers import Trainer, TrainerCallback, TrainingArguments

out = sys.argv[1]
torch.manual_seed(0)
model = build_model()
train = [{"input_ids": torch.tensor(row), "labels": torch.tensor(row)} for row in token_rows()]


class Losses(TrainerCallback):
    seen: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.seen.append(logs["loss"])


args = TrainingArguments(
    output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=20,
    learning_rate=1e-3, warmup_steps=2, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
    report_to=[], use_cpu=True, seed=0, data_seed=0,
)  # fmt: skip
trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[Losses()])
trainer.train()
trainer.save_model(out)
if trainer.is_world_process_zero():
    with open(os.path.join(out, "losses.json"), "w") as file:
        json.dump(Losses.seen, file)
