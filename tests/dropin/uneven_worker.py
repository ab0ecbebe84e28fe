"""Habits that cannot work on a sharded model, under elixir-run: each must end in a clear error, not a hang.

``--case end_eval``: after training, rank 0 alone evaluates while rank 1 waits in a barrier of the
process group the script started itself. ``--case step_after_eval``: rank 0 alone evaluates, then
steps without a forward, while rank 1 starts its next training forward.
"""

import argparse

import torch
import torch.distributed as dist
from nanogpt_model import GPT, GPTConfig

import elixir_tune

parser = argparse.ArgumentParser()
parser.add_argument("--case", required=True)
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = GPT(GPTConfig())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = elixir_tune.setup(model, optimizer)
x = torch.randint(0, 96, (4, 32))
for _ in range(2):
    if args.case == "step_after_eval" and rank == 0:
        with torch.no_grad():
            model(x, x)
        optimizer.step()
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
if rank == 0:
    with torch.no_grad():
        model(x, x)
else:
    dist.barrier()
print("finished", flush=True)
