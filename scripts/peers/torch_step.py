"""Baselines: the same GPT-2 in plain PyTorch (one process) or under DistributedDataParallel.

torch AdamW, gradient clipping at 1.0, activation checkpointing as asked; the record is common.py's
(step times, the largest peak RSS over ranks).

    torchrun --nproc-per-node 2 scripts/peers/torch_step.py --ddp --model m.yaml --micro-batch-size 2 \
        --seq-len 128 --dtype fp32 --out ddp.json
"""

from __future__ import annotations

import sys

import common
import torch


def main() -> int:
    ddp = "--ddp" in sys.argv
    if ddp:
        sys.argv.remove("--ddp")
    args = common.parse_args(__doc__)
    device, rank, world = common.init_distributed()
    model = common.build_model(args.model, args.checkpointing).to(device)
    vocab = model.config.vocab_size
    runner = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    step = common.accumulated_step(runner, model, optimizer, args, vocab, rank, device)

    times, losses = common.timed_steps(step, args.steps, device)
    common.write_record(args, "ddp" if ddp else "plain", times, losses, {"torch": torch.__version__, "world": world})
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
