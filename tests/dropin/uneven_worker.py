"""A sharded model's last acts and rank-0-only habits, under elixir-run (2 ranks, gloo).

Every case trains 2 steps on the same batch on each rank, then runs one DDP habit. Each must work as
under DDP or end in a clear error at once, never wait out the collective timeout. ``--case``:

* ``end_eval``: rank 0 alone evaluates, then both meet in ``dist.barrier()``;
* ``save_barrier``: rank 0 alone saves ``model.state_dict()``, then ``dist.barrier()`` and
  ``dist.destroy_process_group()`` (torchtitan's and most DDP scripts' ending);
* ``save_exit``: rank 0 alone saves; the script then ends on every rank, with no barrier;
* ``save_destroy``: rank 0 alone saves, then every rank calls ``dist.destroy_process_group()``;
* ``accelerate_save``: accelerate's documented ending: ``accelerator.wait_for_everyone()``, then on the
  main process ``accelerator.save(accelerator.unwrap_model(model).state_dict(), ...)``;
* ``generate``: rank 0 alone samples through the module object it kept from before ``setup``
  (minGPT's ``generate``), then saves, then ``dist.barrier()``;
* ``inner_forward``: rank 0 alone runs ``model.module(x)`` under ``no_grad``, then ``dist.barrier()``;
* ``step_after_eval``: rank 0 alone evaluates, then steps without a forward (refused);
* ``train_alone``: rank 0 runs a third training step while rank 1 waits at the barrier (refused).

Rank 0 saves to ``--out``/final.pt; each rank prints "finished" at the end.
"""

import argparse
import os

import torch
import torch.distributed as dist
from nanogpt_model import GPT, GPTConfig

import elixir_tune

parser = argparse.ArgumentParser()
parser.add_argument("--case", required=True)
parser.add_argument("--out", default="out")
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
raw = GPT(GPTConfig())
optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-3)
model, optimizer = elixir_tune.setup(raw, optimizer)
x = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(1))


def save(state):
    os.makedirs(args.out, exist_ok=True)
    torch.save(state, os.path.join(args.out, "final.pt"))


for _ in range(2):
    if args.case == "step_after_eval" and rank == 0:
        with torch.no_grad():
            model(x, x)
        optimizer.step()
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

if args.case == "end_eval":
    if rank == 0:
        with torch.no_grad():
            model(x, x)
    dist.barrier()
elif args.case in ("save_barrier", "save_exit", "save_destroy"):
    if rank == 0:
        save(model.state_dict())
    if args.case == "save_barrier":
        dist.barrier()
    if args.case != "save_exit":
        dist.destroy_process_group()
elif args.case == "accelerate_save":
    from accelerate import Accelerator

    accelerator = Accelerator()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.makedirs(args.out, exist_ok=True)
        accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.out, "final.pt"))
elif args.case == "generate":
    if rank == 0:
        with torch.no_grad():
            raw.generate(x[:1, :8], max_new_tokens=4)
        save(model.state_dict())
    dist.barrier()
elif args.case == "inner_forward":
    if rank == 0:
        with torch.no_grad():
            model.module(x, x)
        save(model.module.state_dict())
    dist.barrier()
elif args.case == "train_alone":
    if rank == 0:
        _, loss = model(x, x)
        loss.backward()
    dist.barrier()
print("finished", flush=True)
