"""The engine on CUDA (one GPU, one process): skipped without CUDA.

Same comparisons as tests/distributed on the GPU: fp32 against plain PyTorch (1e-5), bf16 against
torch.autocast, the offload path through pinned host memory with the CPU optimizer step, and the
memory report.
"""

from __future__ import annotations

import pytest
import torch

import elixir_tune
from tests.distributed.engine_plans import batches, make_plan, param_groups, tied_net, tiny_gpt2

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without CUDA

STEPS = 10


def train(build, plan_kwargs, dtype="fp32", accum=2, clip=0.5):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    data = [{k: v.cuda() for k, v in b.items()} for b in batches(STEPS, 4, 8)]
    model = build()
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, eps=1e-6)
    block_list = "transformer.h" if hasattr(model, "transformer") else "body"
    plan = make_plan(
        model,
        1,
        plan_kwargs.pop("chunk_size"),
        dtype=dtype,
        block_list=block_list,
        micro_batch_size=4 // accum,
        grad_accum_steps=accum,
        device="cuda",
        **plan_kwargs,
    )
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    losses = []
    for batch in data:
        total = 0.0
        for k in range(accum):
            micro = {key: value[k * 4 // accum : (k + 1) * 4 // accum] for key, value in batch.items()}
            loss = model(**micro).loss / accum
            opt.backward(loss)
            total += float(loss.detach())
        opt.clip_grad_norm(clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)

    ref = build().cuda()
    ref_opt = torch.optim.AdamW(param_groups(ref), lr=3e-3, eps=1e-6)
    ref_losses = []
    for batch in data:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = ref(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss.detach()))
    state, ref_state = model.state_dict(), ref.state_dict()
    weight = max(float((state[k].float() - v.float().cpu()).abs().max()) for k, v in ref_state.items())
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    return loss_rel, weight, model, plan


@pytest.mark.parametrize(
    "build,kwargs",
    [
        (tiny_gpt2, dict(chunk_size=4096, cache="all")),
        (tiny_gpt2, dict(chunk_size=4096, cache="min", offload=0.5, prefetch=2, checkpoint_every=1)),
        (tied_net, dict(chunk_size=1024, cache="min", offload=1.0, checkpoint_every=1)),
    ],
)
def test_fp32_matches_torch_on_gpu(build, kwargs):
    loss_rel, weight, model, plan = train(build, dict(kwargs))
    assert loss_rel <= 1e-5 and weight <= 1e-5, (loss_rel, weight)
    report = model.memory_report()
    shard = plan.memory.chunk_size
    offloaded = sum(c.offload for c in plan.memory.chunks)
    assert report["host_shard_bytes"] == 16 * shard * offloaded
    assert report["device_shard_bytes"] == 16 * shard * (len(plan.memory.chunks) - offloaded)
    # What crosses the link is the upload copy (the master itself in fp32), in one pinned block.
    assert all(c.upload.is_pinned() for c in model.engine.chunks if c.offload)
    assert report["host_copy_bytes"] + 4 * shard * offloaded == 1 << (4 * shard * offloaded - 1).bit_length()


def test_bf16_tracks_autocast_on_gpu():
    loss_rel, weight, _, _ = train(tiny_gpt2, dict(chunk_size=4096, cache="min", offload=0.5, prefetch=2), dtype="bf16")
    assert loss_rel < 2e-2 and weight < 5e-2, (loss_rel, weight)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_default_step_never_waits_for_the_device(dtype):
    """After the first step (which learns that every parameter gets a gradient), a step with clipping
    and fp16 loss scaling issues no host synchronization: torch's sync debug mode raises on one."""
    model = tiny_gpt2()
    plan = make_plan(model, 1, 4096, cache="min", prefetch=2, dtype=dtype, block_list="transformer.h", device="cuda")
    model, opt = elixir_tune.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan=plan)
    batch = {k: v.cuda() for k, v in batches(1, 2, 8)[0].items()}

    def step():
        opt.backward(model(**batch).loss)
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.skipped_steps == 0
