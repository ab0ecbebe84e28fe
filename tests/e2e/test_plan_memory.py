"""A plan from the real profiler and search runs in the engine, and the engine's model-state memory
and its other buffers (staging pool, upload copies, landing buffers) equal what the search
predicted, for several plan shapes (world size 1, in-process)."""

from __future__ import annotations

import pytest
import torch

import elixir_tune
from elixir_tune.hardware import load_hardware
from elixir_tune.profiler import load_model_source, profile_model
from elixir_tune.search import search


@pytest.fixture(scope="module")
def tiny():
    source = load_model_source("gpt2-tiny")
    return source, profile_model(source, batch_size=2, seq_len=32, checkpointing="all")


SHAPES = [
    {"offload": 0.0, "cache_blocks": "all", "prefetch": 0, "checkpointing": "none"},
    {"offload": 0.5, "prefetch": 1, "checkpointing": "all"},
    {"offload": 1.0, "checkpointing": "all", "micro_batch_size": 1},
]


@pytest.mark.parametrize("fixed", SHAPES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_engine_model_states_equal_the_prediction(tiny, fixed: dict):
    source, profile = tiny
    plan = search(profile, load_hardware("cpu"), gpus_per_node=1, global_batch_size=2, fixed=fixed).plan
    assert plan.training.seq_len == 32
    torch.manual_seed(0)
    model = source.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
    predicted = {**plan.prediction.model_state_bytes, **plan.prediction.transient_bytes}
    assert model.memory_report() == predicted

    batch = source.example_batch(plan.training.micro_batch_size, plan.training.seq_len)
    losses = []
    for _ in range(3):
        for _ in range(plan.training.grad_accum_steps):
            loss = model(**batch).loss
            optimizer.backward(loss / plan.training.grad_accum_steps)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]  # the same batch three times: a working step lowers its loss
    assert model.memory_report() == predicted
