"""The gradient staging pool is bounded, and its size does not change the result (world of one)."""

from __future__ import annotations

import pytest
import torch

import elixir_tune
from tests.distributed.engine_plans import batches, make_plan, pack


def gpt2_layers(layers: int, seed: int = 0) -> torch.nn.Module:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = GPT2Config(
        n_embd=32, n_layer=layers, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def twelve_chunk_size(model: torch.nn.Module) -> int:
    for size in range(4096, 16384, 64):
        if len(pack(model, size)) == 12:
            return size
    raise AssertionError("no chunk size gives 12 chunks")


def held_buffers(engine) -> set[int]:
    """Staging buffers referenced by chunks right now (filling or reducing), by storage address."""
    held = set()
    for chunk in engine.chunks:
        if chunk.staging is not None:
            held.add(chunk.staging.full.data_ptr())
        if chunk.pending is not None:
            held.add(chunk.pending[0].full.data_ptr())
    return held


@pytest.mark.parametrize("staging_buffers,offload", [(2, 0.0), (2, 0.5), (1, 0.5), (3, 0.0)])
def test_live_staging_buffers_never_exceed_the_pool(staging_buffers: int, offload: float):
    model = gpt2_layers(4)
    size = twelve_chunk_size(model)
    plan = make_plan(model, 1, size, cache=2, offload=offload, staging_buffers=staging_buffers, seq_len=16)
    assert len(plan.memory.chunks) == 12
    wrapped, opt = elixir_tune.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan=plan)
    engine = wrapped.engine
    seen_live, seen_addresses = [], set()

    def count(_param):  # runs after the engine's own hook on the same parameter
        held = held_buffers(engine)
        seen_live.append(len(held))
        seen_addresses.update(held)

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(count)
    for batch in batches(2, 2, 16):
        for _ in range(2):  # accumulation: the second backward starts with host reductions still in flight
            opt.backward(wrapped(**batch).loss)
        opt.step()
        opt.zero_grad()
    assert seen_live and max(seen_live) <= staging_buffers
    assert max(seen_live) == staging_buffers  # twelve chunks do use the whole pool
    assert len(seen_addresses) <= staging_buffers  # and never a buffer outside it
    assert engine.grads.staging.peak_live == staging_buffers
    assert engine.memory_report()["staging_bytes"] == staging_buffers * size * 4


def test_pool_size_does_not_change_the_result():
    """One buffer forces partial reductions of chunks whose gradients are still arriving."""
    results = []
    for staging_buffers in (1, 2, 12):
        model = gpt2_layers(4)
        plan = make_plan(model, 1, twelve_chunk_size(model), cache=2, offload=0.5, staging_buffers=staging_buffers)
        wrapped, opt = elixir_tune.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan=plan)
        for batch in batches(2, 2, 8):
            opt.backward(wrapped(**batch).loss)
            opt.clip_grad_norm(0.5)
            opt.step()
            opt.zero_grad()
        results.append(wrapped.state_dict())
    for other in results[1:]:
        for key, value in results[0].items():
            assert torch.equal(value, other[key]), key


def test_a_cpu_staging_pool_costs_memory_only_once_used():
    """acquire() zeroes a buffer as it hands it out, so a CPU pool's pages become resident at the first
    backward, not at setup (GPT-2 774M's setup: two 64M-element fp32 buffers, 0.48 GiB)."""
    from pathlib import Path

    from elixir_tune.engine.chunks.staging import StagingPool

    def resident_bytes() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    chunk = 16 << 20  # 64 MiB per buffer in fp32
    before = resident_bytes()
    pool = StagingPool(2, chunk, rank=0, world_size=2, dtype=torch.float32, device=torch.device("cpu"), landing=False)
    assert resident_bytes() - before < 16 << 20  # not the pool's 128 MiB
    buffer = pool.acquire()
    assert buffer is not None and not buffer.full.any()  # handed out zeroed
    assert resident_bytes() - before >= 48 << 20  # now its pages are there
