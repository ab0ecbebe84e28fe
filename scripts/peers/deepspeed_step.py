"""Peer: the same GPT-2 under DeepSpeed ZeRO-3 with optimizer and parameter offload to the CPU.

The configuration a user would write for a model that does not fit: stage 3, `offload_optimizer`
and `offload_param` to pinned CPU memory, bf16, DeepSpeed's CPU Adam (its C++ op, compiled on first
use: the compile time is reported apart from the step times), gradient clipping 1.0, activation
checkpointing as our plan has it. Parameters are created partitioned (`deepspeed.zero.Init`).

    torchrun --nproc-per-node 1 scripts/peers/deepspeed_step.py --model m.yaml --micro-batch-size 4 \
        --seq-len 1024 --checkpointing all --out deepspeed.json
"""

from __future__ import annotations

import time

import common
import torch


def config(args, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.grad_accum_steps,
        "train_batch_size": args.micro_batch_size * args.grad_accum_steps * world,
        "bf16": {"enabled": args.dtype == "bf16"},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def main() -> int:
    args = common.parse_args(__doc__)
    device, rank, world = common.init_distributed()
    import deepspeed

    ds_config = config(args, world)
    started = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = common.build_model(args.model, args.checkpointing)
    vocab = model.config.vocab_size
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    setup_s = time.perf_counter() - started  # includes compiling the CPU Adam op on first use

    def step(index: int) -> float:
        total = 0.0
        for micro in range(args.grad_accum_steps):
            ids = common.batch(
                index * args.grad_accum_steps + micro, args.micro_batch_size, args.seq_len, vocab, rank, device
            )
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
            total += float(loss.detach()) / args.grad_accum_steps
        return total

    times, losses = common.timed_steps(step, args.steps, device)
    extra = {"deepspeed": deepspeed.__version__, "setup_s": setup_s, "config": ds_config}
    common.write_record(args, "deepspeed-zero3-offload", times, losses, extra)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
