"""A TRL SFTTrainer script as its users write it, with nothing of elixir-tune in it: a tiny Llama from a
config, token rows, 20 steps of 4 x 2 accumulation per rank, clipping, a warm-up schedule, then
``trainer.save_model(OUT)``. SFTTrainer patches TRL's fused LM head onto the model. ``bf16=False``: the
run is fp32 (SFTConfig's default bf16=True would make the reference autocast in bf16). Rank 0 writes the
logged losses to ``OUT/losses.json``. Usage: ``train_trl.py OUT``."""

import json
import os
import sys

import torch
from datasets import Dataset
from tiny_llama_model import VOCAB, build_model, token_rows
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, TrainerCallback
from trl import SFTConfig, SFTTrainer

out = sys.argv[1]
torch.manual_seed(0)
model = build_model()
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1")),
    pad_token="t0", eos_token="t2",
)  # fmt: skip
train = Dataset.from_list([{"input_ids": row} for row in token_rows()])


class Losses(TrainerCallback):
    seen: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.seen.append(logs["loss"])


args = SFTConfig(
    output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=20,
    learning_rate=1e-3, warmup_steps=2, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
    report_to=[], use_cpu=True, seed=0, data_seed=0, max_length=32, bf16=False,
)  # fmt: skip
trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer, callbacks=[Losses()])
trainer.train()
trainer.save_model(out)
if trainer.is_world_process_zero():
    with open(os.path.join(out, "losses.json"), "w") as file:
        json.dump(Losses.seen, file)
