"""One worker of the probe's engine measurement (``cli/probe_engine.py``): trains a tiny model under each
of a few plans with the engine and records each step's time.

Started by ``probe_engine.run_engine_workers`` as ``python -m elixir_tune.cli.probe_engine_worker CONFIG``
with the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): ``elixir_tune.setup``
starts the process group from it. Each plan runs the training step a user's loop runs (the pretrain
recipe's: ``forward_backward`` on the rank's micro-batches with labels, gradient clipping, the
optimizer's step) on random tokens, ``warmup`` steps untimed and ``steps`` timed. Rank 0 writes
``{plan name: [seconds per timed step]}`` as JSON: every step ends in collectives over all ranks
(the pipeline's loss broadcast, the data group's reductions), so rank 0's time is the step's.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def _micro_batches(plan, data_rank: int, data_size: int, step: int, vocab_size: int) -> list[dict]:
    """This data rank's rows of a global batch of random tokens, cut into the plan's micro-batches."""
    training = plan.training
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab_size, (training.global_batch_size, training.seq_len), generator=generator)
    rows = ids.chunk(data_size)[data_rank]
    micro = training.micro_batch_size
    return [{"input_ids": rows[b : b + micro], "labels": rows[b : b + micro]} for b in range(0, len(rows), micro)]


def time_plan(model_path: str, plan_path: str, warmup: int, steps: int) -> list[float]:
    """Seconds of each timed training step of the model under the plan (this rank's clock).

    Args:
        model_path: the model YAML (``profiler.load_model_source``) the plan was searched for.
        plan_path: the plan.
        warmup: untimed steps first (the first step records the chunk trace and checks the model).
        steps: timed steps.

    Returns:
        One time per timed step.
    """
    import elixir_tune
    from elixir_tune.profiler import load_model_source

    plan = elixir_tune.load_plan(plan_path)
    torch.manual_seed(0)  # the same initial weights on every rank
    source = load_model_source(model_path)
    model = source.build_model()
    vocab_size = int(model.config.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
    data_rank, data_size = elixir_tune.data_rank(), elixir_tune.data_size()
    times = []
    for step in range(warmup + steps):
        micro_batches = _micro_batches(plan, data_rank, data_size, step, vocab_size)
        begin = time.perf_counter()
        model.forward_backward(micro_batches)
        optimizer.clip_grad_norm(1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step >= warmup:
            times.append(time.perf_counter() - begin)
    return times


def main(config_path: str) -> None:
    """Times every plan of the config in turn; rank 0 writes the times to the config's ``out_path``."""
    with open(config_path) as file:
        config = json.load(file)
    torch.set_num_threads(config["threads"])
    results = {
        name: time_plan(config["model_path"], plan_path, config["warmup"], config["steps"])
        for name, plan_path in config["plans"].items()
    }
    if os.environ.get("RANK", "0") == "0":
        with open(config["out_path"], "w") as out:
            json.dump(results, out)


if __name__ == "__main__":
    from elixir_tune.worker_exit import exit_worker

    main(sys.argv[1])
    exit_worker(0)  # the times are written: no C++ teardown to abort in (elixir_tune/worker_exit.py)
