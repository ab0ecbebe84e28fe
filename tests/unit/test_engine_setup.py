"""Engine setup, errors, memory report and buffers, in one process (a world of one needs no group)."""

from __future__ import annotations

import copy

import pytest
import torch

import elixir_tune
from elixir_tune.plan import MODEL_STATE_KEYS, SHARD_BYTES_PER_ELEMENT
from elixir_tune.plan.memory import TRANSIENT_KEYS
from tests.distributed.engine_plans import batches, make_plan, param_groups, tied_net, tiny_gpt2


def setup_tied(**plan_kwargs):
    model = tied_net()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, eps=1e-6)
    plan = make_plan(model, 1, plan_kwargs.pop("chunk_size", 1024), block_list="body", **plan_kwargs)
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    return model, opt, plan, reference


def train_step(model, opt, batch, clip=0.0):
    loss = model(**batch).loss
    opt.backward(loss)
    norm = opt.clip_grad_norm(clip) if clip else None
    opt.step()
    opt.zero_grad()
    return loss, norm


def test_fingerprint_mismatch_is_a_clear_error():
    model = tied_net()
    plan = make_plan(model, 1, 1024)
    other = tiny_gpt2()
    with pytest.raises(ValueError, match="another model.*elixir-tune profile"):
        elixir_tune.setup(other, torch.optim.AdamW(other.parameters()), plan=plan)


def test_world_size_mismatch_is_a_clear_error():
    model = tied_net()
    plan = make_plan(model, 2, 1024)
    with pytest.raises(RuntimeError, match="plan needs 2 processes"):
        elixir_tune.setup(model, torch.optim.AdamW(model.parameters()), plan=plan)


def test_too_few_cache_blocks_names_module_and_minimum():
    from tests.distributed.engine_plans import min_cache_blocks, pack

    model = tied_net()
    # A chunk size that puts some module's weight and bias into different chunks.
    size = next(c for c in range(1040, 2048, 16) if min_cache_blocks(model, pack(model, c), set()) == 2)
    plan = make_plan(model, 1, size, cache=1)
    with pytest.raises(ValueError, match=r"module '.*' uses 2 non-resident chunks.*minimum for this chunking is 2"):
        elixir_tune.setup(model, torch.optim.AdamW(model.parameters()), plan=plan)


def test_state_dict_has_original_names_and_weights():
    model, _, _, reference = setup_tied(cache="min")
    state = model.state_dict()
    assert list(state) == list(reference)
    for key, value in reference.items():
        assert torch.equal(state[key], value), key


def test_state_dict_inside_an_enclosing_module_is_prefixed():
    # nn.Module.state_dict collects a child's entries through destination= and prefix=.
    model, _, _, reference = setup_tied(cache="min")
    outer = torch.nn.ModuleDict({"inner": model})
    state = outer.state_dict()
    assert list(state) == ["inner." + key for key in reference]
    for key, value in reference.items():
        assert torch.equal(state["inner." + key], value), key


def test_memory_report_equals_the_plan_formulas():
    model, opt, plan, _ = setup_tied(cache=2, offload=0.5, resident=(0,))
    report = model.memory_report()
    assert tuple(report) == MODEL_STATE_KEYS + TRANSIENT_KEYS
    shard = plan.memory.chunk_size
    adam = SHARD_BYTES_PER_ELEMENT["adam"]
    n_off = sum(c.offload for c in plan.memory.chunks)
    assert report == {
        "cache_bytes": 2 * plan.memory.chunk_size * 4,
        "resident_bytes": plan.memory.chunk_size * 4,
        "device_shard_bytes": (len(plan.memory.chunks) - n_off) * shard * adam,
        "host_shard_bytes": n_off * shard * adam,
        "staging_bytes": 2 * plan.memory.chunk_size * 4,  # two staging buffers, no separate output at world 1
        "host_copy_bytes": 0,  # fp32: the offloaded masters are what goes up
        "landing_bytes": 0,  # a cpu device: reduced shards are added from the staging buffer
        "held_grad_bytes": 0,  # no pipeline: every gradient is staged as it arrives
    }
    train_step(model, opt, batches(1, 2, 8)[0])
    assert model.memory_report() == report  # optimizer state is preallocated: no growth at the first step
    assert model.engine.memory_stats()["peak_cache_bytes"] <= report["cache_bytes"]


def test_parameters_hold_no_data_outside_training_except_resident():
    model, opt, plan, _ = setup_tied(cache="min", resident=(0,))
    train_step(model, opt, batches(1, 2, 8)[0])
    resident = set(plan.memory.chunks[0].params)
    for name, param in model.module.named_parameters():
        if not param.requires_grad:
            continue
        if name in resident:
            assert param.untyped_storage().nbytes() > 0
        else:
            assert param.untyped_storage().nbytes() <= 4, name  # the shared 1-element placeholder
            assert param.shape == param.data.shape  # shapes stay what the model expects


def test_minimum_cache_evicts_and_regathers():
    model, opt, plan, _ = setup_tied(cache="min", chunk_size=1024)
    assert plan.memory.cache_blocks < len(plan.memory.chunks)
    train_step(model, opt, batches(1, 2, 8)[0])
    stats = model.engine.memory_stats()
    assert stats["gathers"] > len(plan.memory.chunks)  # backward gathered evicted chunks again
    assert stats["peak_cache_bytes"] == plan.memory.cache_blocks * plan.memory.chunk_size * 4


def test_lr_written_into_param_groups_takes_effect():
    model, opt, _, _ = setup_tied()
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    for group in opt.param_groups:
        group["lr"] = 0.0  # what an LR scheduler does
    before = model.state_dict()
    train_step(model, opt, batches(1, 2, 8)[0])
    after = model.state_dict()
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_clip_grad_norm_matches_torch():
    batch = batches(1, 2, 8)[0]
    reference = tied_net()
    reference(**batch).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    model, opt, _, _ = setup_tied(cache="min", offload=0.5)
    _, norm = train_step(model, opt, batch, clip=0.1)
    assert abs(float(norm) - float(expected)) <= 1e-5 * float(expected)


def test_fp16_overflow_skips_the_step_and_backs_off():
    model, opt, _, _ = setup_tied(dtype="fp16")
    batch = batches(1, 2, 8)[0]
    before = model.state_dict()
    opt.backward(model(**batch).loss)
    model.engine.chunks[1].grad[3] = float("inf")
    opt.step()
    opt.zero_grad()
    assert opt.skipped_steps == 1 and opt.loss_scale == 2.0**15
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    train_step(model, opt, batch)
    assert opt.skipped_steps == 1
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_plan_from_environment(tmp_path, monkeypatch):
    from elixir_tune.plan import save_plan

    model = tied_net()
    plan = make_plan(model, 1, 1024)
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    monkeypatch.setenv("ELIXIR_TUNE_PLAN", str(path))
    wrapped, opt = elixir_tune.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loss, _ = train_step(wrapped, opt, batches(1, 2, 8)[0])
    assert torch.isfinite(loss)
    assert opt.optimizer_class is torch.optim.SGD
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]) == (0.1, 0.9)


def test_eval_forward_without_grad_matches_the_model():
    batch = batches(1, 2, 8)[0]
    reference = tied_net().eval()
    with torch.no_grad():
        expected = reference(**batch).loss
    model, _, _, _ = setup_tied(cache="min", offload=0.5)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(**batch).loss, expected, rtol=1e-6)


def test_load_state_dict_round_trip():
    model, opt, _, reference = setup_tied(cache="min", resident=(0,))
    train_step(model, opt, batches(1, 2, 8)[0])
    assert any(not torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    model.load_state_dict(reference)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.items())


def test_optimizer_state_dict_round_trip_keeps_training_identical():
    data = batches(3, 2, 8)
    model, opt, _, _ = setup_tied(cache="min")
    train_step(model, opt, data[0])
    weights, saved = model.state_dict(), copy.deepcopy(opt.state_dict())  # torch returns references
    train_step(model, opt, data[1])
    expected = model.state_dict()
    bytes_before = model.memory_report()
    model.load_state_dict(weights)
    opt.load_state_dict(saved)
    train_step(model, opt, data[1])
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert model.memory_report() == bytes_before


def test_device_follows_local_rank_and_visible_devices(monkeypatch):
    from elixir_tune.engine.worker import pick_device

    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # torchrun on a 4-GPU node
    assert pick_device("cuda") == torch.device("cuda", 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # CUDA_VISIBLE_DEVICES narrowed per process
    assert pick_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match="LOCAL_RANK is 2 but this process sees 2 GPUs"):
        pick_device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="no GPU is visible"):
        pick_device("cuda")


def test_parameters_start_16_byte_aligned_in_their_chunk():
    model = tiny_gpt2()
    plan = make_plan(model, 1, 4096, dtype="bf16")
    wrapped, opt = elixir_tune.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan=plan)
    seen = []

    def check(module, args):
        for param in module.parameters(recurse=False):
            seen.append(param.data_ptr() % 16)

    for module in wrapped.module.modules():
        module.register_forward_pre_hook(check)  # runs after the engine's hook: parameters gathered
    train_step(wrapped, opt, batches(1, 2, 8)[0])
    assert seen and set(seen) == {0}
    assert all(slot.offset % 8 == 0 for chunk in wrapped.engine.chunks for slot in chunk.slots)


def test_a_plan_packed_without_padding_still_runs():
    from elixir_tune.plan import ChunkPlan, MemoryPlan

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))  # 15, 5, 10, 2 elements

    model = build()
    plan = make_plan(model, 1, 64)
    names = [name for name, _ in model.named_parameters()]
    # As an older search packed it: back to back, 32 elements in a chunk of 32 (padded they need 34).
    plan.memory = MemoryPlan(chunk_size=32, cache_blocks=1, prefetch=0, chunks=[ChunkPlan(0, names, 32)])
    x = torch.randn(4, 3)
    reference = build()
    reference(x).square().sum().backward()
    with pytest.warns(UserWarning, match="without alignment padding"):
        wrapped, opt = elixir_tune.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), plan=plan)
    opt.backward(wrapped(x).square().sum())
    opt.step()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    state = wrapped.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.allclose(state[name], value, atol=1e-6), name
