"""Worker for the selective-checkpointing test: a real profile and search with every block checkpointed
selectively (torchtitan's per-op policy), four training steps through the engine's plain loop, the
second one measured (``memory_probe``), and rank 0 trains the same global batches in plain PyTorch.

Each case: ``model`` (a config name or YAML path), ``offload`` (the pinned share) and optionally
``checkpointing`` (default ``selective``; ``all``: the full recomputation, the control).
"""

from __future__ import annotations

import torch

import elixir_tune
from elixir_tune.hardware import load_hardware
from elixir_tune.profiler import load_model_source, profile_model
from elixir_tune.search import search
from tests.distributed.engine_launch import worker_main
from tests.distributed.engine_worker import compare, local_micro, mean_over_ranks, plain_training
from tests.distributed.memory_probe import peak_step_bytes

SEQ = 64
VOCAB = 256
CHUNK_SIZE = 16384
MICRO = 2
STEPS = 4
_PROFILES: dict[str, tuple] = {}


def profiled(name: str):
    if name not in _PROFILES:
        source = load_model_source(name)
        _PROFILES[name] = (source, profile_model(source, batch_size=2, seq_len=SEQ, checkpointing="all"))
    return _PROFILES[name]


def make_plan(case: dict, world: int):
    source, profile = profiled(case["model"])
    fixed = dict(
        checkpointing=case.get("checkpointing", "selective"),
        offload=case["offload"],
        micro_batch_size=MICRO,
        chunk_size=CHUNK_SIZE,
        prefetch=0,
        dtype="fp32",
        pipeline=1,
        tensor=1,
    )
    result = search(profile, load_hardware("cpu"), gpus_per_node=world, global_batch_size=MICRO * world, fixed=fixed)
    return source, result


def global_batches(world: int) -> list[dict[str, torch.Tensor]]:
    """Deterministic global batches, the same in every process (ids from 2: OPT's pad id is 1)."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(2, VOCAB, (MICRO * world, SEQ), generator=generator)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def built(source):
    torch.manual_seed(0)
    model = source.build_model().train()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    source, result = make_plan(case, world)
    plan = result.plan
    model, optimizer = built(source)
    model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
    batches = global_batches(world)
    losses: list[float] = []

    def step(batch: dict) -> None:
        loss = model(**local_micro(batch, rank, world, 1, 0)).loss
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))

    # The first step records the access order; the second, a steady one, is measured.
    measured = peak_step_bytes(lambda: step(batches[1]), model.engine.device, warmup=lambda: step(batches[0]))
    for batch in batches[2:]:
        step(batch)
    full = model.state_dict()  # a collective: every rank calls it
    memory = result.candidates[0].memory
    out = {
        "case": case,
        "mode": plan.training.activation_checkpointing.mode,
        "every": plan.training.activation_checkpointing.every,
        "offloaded": sum(chunk.offload for chunk in plan.memory.chunks),
        "measured": measured,
        "predicted_bytes": memory.peak_gpu_bytes + memory.peak_host_bytes // world,
        "predicted_activation_bytes": memory.activation_bytes,
        "world_losses": mean_over_ranks(losses, world),
    }
    if rank == 0:
        reference = plain_training(*built(source), batches)
        engine = {"state": {k: v.tolist() for k, v in full.items()}, "norms": []}
        out.update(compare(engine, reference, out["world_losses"]))
    return out


if __name__ == "__main__":
    worker_main(run_case)
