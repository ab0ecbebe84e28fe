"""Peer: the same GPT-2 under PyTorch FSDP2, as a user would set it up for a model that does not fit.

`fully_shard` on every transformer block and on the root, `CPUOffloadPolicy` (parameters, gradients
and the optimizer step on the host; all-or-nothing), bf16 `MixedPrecisionPolicy` (fp32 reduce),
activation checkpointing as our plan has it, torch AdamW on the host (fused where torch has it).
On a CPU dry run the CPU is the device: no offload policy, the dtype as given.

    torchrun --nproc-per-node 1 scripts/peers/fsdp2_step.py --model m.yaml --micro-batch-size 4 \
        --seq-len 1024 --checkpointing all --out fsdp2.json
"""

from __future__ import annotations

import common
import torch


def fsdp_api():
    """fully_shard and its policies: public in torch >= 2.6, under _composable before."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    return fully_shard, CPUOffloadPolicy, MixedPrecisionPolicy


def main() -> int:
    args = common.parse_args(__doc__)
    device, rank, world = common.init_distributed()
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, CPUOffloadPolicy, MixedPrecisionPolicy = fsdp_api()
    model = common.build_model(args.model, args.checkpointing)
    vocab = model.config.vocab_size
    mesh = init_device_mesh(device.type, (world,))
    options = {"mesh": mesh}
    if device.type == "cuda":
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    if args.dtype == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, **options)
    fully_shard(model, **options)
    if device.type == "cuda" and "offload_policy" not in options:
        model.to(device)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except (RuntimeError, ValueError, TypeError):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    step = common.accumulated_step(model, model, optimizer, args, vocab, rank, device)

    times, losses = common.timed_steps(step, args.steps, device)
    policy = "CPUOffloadPolicy(pin_memory=True)" if "offload_policy" in options else "none (the CPU is the device)"
    common.write_record(args, "fsdp2", times, losses, {"offload_policy": policy, "torch": torch.__version__})
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
