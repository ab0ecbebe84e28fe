"""A plan from the real profiler and search runs in the engine, and the model-state memory the engine
really holds equals what the search predicted, for several plan shapes (world size 1, in-process).

"Really holds" is read from the tensors, not from ``memory_report()`` (which shares the plan's
formula for the cache): the storages of each chunk's fp32 master and gradient, of the optimizer
states torch steps for the chunk's parameters, of the resident payloads, and the peak bytes of
gathered payloads the cache held during the steps. The engine's other buffers (staging pool, upload
copies, landing buffers) equal the prediction's transient bytes."""

from __future__ import annotations

import pytest
import torch

import elixir_tune
from elixir_tune.hardware import load_hardware
from elixir_tune.plan import MODEL_STATE_KEYS
from elixir_tune.profiler import load_model_source, profile_model
from elixir_tune.search import search


def held_model_state_bytes(model, optimizer) -> dict[str, int]:
    """Model-state bytes of this rank read from the storages the engine and the optimizer hold.

    Storages are counted once per side (device shards, host shards): the fp32 masters of offloaded
    chunks are views of one upload block that they share.
    """
    engine = model.engine
    side_of_storage = {}
    storages: dict[str, dict[int, int]] = {"host_shard_bytes": {}, "device_shard_bytes": {}}
    for chunk in engine.chunks:
        side = "host_shard_bytes" if chunk.offload else "device_shard_bytes"
        for tensor in (chunk.master, chunk.grad):
            side_of_storage[tensor.untyped_storage().data_ptr()] = side
            storages[side][tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    for inner, _ in optimizer._inner:  # the torch optimizers stepping the shards
        for param, state in inner.state.items():
            side = side_of_storage[param.untyped_storage().data_ptr()]
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:  # not the scalar step count
                    storages[side][value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    held = dict.fromkeys(MODEL_STATE_KEYS, 0)
    for side, sizes in storages.items():
        held[side] = sum(sizes.values())
    held["resident_bytes"] = sum(c.payload.untyped_storage().nbytes() for c in engine.chunks if c.resident)
    held["cache_bytes"] = engine.memory_stats()["peak_cache_bytes"]
    return held


@pytest.fixture(scope="module")
def tiny():
    source = load_model_source("gpt2-tiny")
    return source, profile_model(source, batch_size=2, seq_len=32, checkpointing="all")


SHAPES = [
    {"offload": 0.0, "cache_blocks": "all", "prefetch": 0, "checkpointing": "none"},
    {"offload": 0.5, "cache_blocks": 3, "prefetch": 1, "checkpointing": "all"},
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
    assert held_model_state_bytes(model, optimizer) == plan.prediction.model_state_bytes
    assert model.memory_report() == predicted
