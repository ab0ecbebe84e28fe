"""Parameters read outside their own module's forward: what the profiler records, what the plan
carries, and the engine (one process, a world of one) gathering them, or refusing clearly at the
first step when the plan does not record a read.

The models are in ``models/foreign_reads.py``: a parent reading a child's weight (functional call,
the child never called), a module reading a sibling's weight, a parameter shared by two modules,
a tied head, and the model itself reading a child's weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import elixir_tune
from elixir_tune.costmodel import CostModel
from elixir_tune.engine.read_guard import UngatheredRead
from elixir_tune.hardware import load_hardware
from elixir_tune.plan import validate
from elixir_tune.plan.schema import ForeignRead
from elixir_tune.profiler import load_model_source, load_profile, profile_model, save_profile
from elixir_tune.search import search

MODELS = Path(__file__).parent / "models"
SPEC = str(MODELS / "foreign_reads.py")
RUNTIME_SPEC = f"{SPEC}:build_runtime_reader"
CHUNK_SIZE = 512
STEPS = 4


@pytest.fixture(scope="module")
def profile():
    return profile_model(SPEC, batch_size=2, seq_len=4, checkpointing="all")


def test_profiler_records_reads_outside_the_owning_module(profile):
    assert profile.foreign_reads == [
        ForeignRead(module="", params=["final.weight", "final.bias"]),  # the model reads its child's
        ForeignRead(module="blocks.0.left", params=["blocks.0.right.weight"]),  # a sibling's weight
        ForeignRead(module="blocks.0.mixer", params=["blocks.0.mixer.conv.weight", "blocks.0.mixer.conv.bias"]),
        ForeignRead(module="blocks.1.left", params=["blocks.1.right.weight"]),
        ForeignRead(module="blocks.1.mixer", params=["blocks.1.mixer.conv.weight", "blocks.1.mixer.conv.bias"]),
    ]
    # Shared and tied parameters are owned by every module that registers them: no foreign read.
    names = [p.name for p in profile.params]
    shared = {p.name for p in profile.params if p.shared}
    assert shared == {"embed.weight", "blocks.0.right.scale", "blocks.1.right.scale"}
    assert not shared & {name for read in profile.foreign_reads for name in read.params}
    # A read parameter is first used at its reader's step: it follows the reader's own in first-use
    # order, and the reader's steps (forward and backward) list it.
    index = {name: i for i, name in enumerate(names)}
    conv = [index["blocks.0.mixer.conv.weight"], index["blocks.0.mixer.conv.bias"]]
    assert conv == [index["blocks.0.right.weight"] + 1, index["blocks.0.right.weight"] + 2]
    assert profile.trace.count(conv) == 2  # the mixer owns nothing: its forward and backward steps
    left = [index["blocks.0.left.weight"], index["blocks.0.right.scale"], index["blocks.0.right.weight"]]
    assert profile.trace.count(left) == 2
    assert profile.trace.count([index["final.weight"], index["final.bias"]]) == 2  # the model's own steps
    # Blocks still own consecutive parameters (what the cost model's checkpointing trace relies on).
    for block in profile.blocks:
        owned = names[block.first_param : block.first_param + block.num_params]
        assert all(name.startswith(f"blocks.{block.index}.") for name in owned), owned
    # With checkpointing the recomputed mixer reads them again: its recomputed step lists them.
    assert profile.trace_checkpointed.count(conv) == 3


def test_a_read_the_meta_trace_cannot_see_is_not_recorded():
    runtime = profile_model(RUNTIME_SPEC, batch_size=2, seq_len=4)
    mixer = next(read for read in runtime.foreign_reads if read.module == "blocks.0.mixer")
    assert mixer.params == ["blocks.0.mixer.conv.weight", "blocks.0.mixer.conv.bias"]  # not right.weight


def test_profile_round_trips_and_an_older_profile_loads(profile, tmp_path: Path):
    save_profile(profile, tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml").foreign_reads == profile.foreign_reads
    raw = yaml.safe_load((tmp_path / "p.yaml").read_text())
    del raw["foreign_reads"]  # as written before foreign reads were recorded
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(raw))
    assert load_profile(tmp_path / "old.yaml").foreign_reads == []


def make_plan(profile, checkpointing: str):
    hardware = load_hardware("cpu")
    every = 1 if checkpointing == "all" else 0
    cacheable_min = CostModel(profile, hardware, 1).min_cache_blocks(CHUNK_SIZE, every)
    fixed = {
        "chunk_size": CHUNK_SIZE,
        "offload": 0.5,
        "checkpointing": checkpointing,
        # The smallest cache the search allows: the engine must accept it (the model reads final.* in
        # its own forward, so those chunks stay gathered beside every module's own).
        "cache_blocks": cacheable_min,
        "prefetch": 0,
        "micro_batch_size": 2,
        "pipeline": 1,
        "tensor": 1,
    }
    return search(profile, hardware, gpus_per_node=1, global_batch_size=2, fixed=fixed).plan


def build(spec: str = SPEC):
    torch.manual_seed(0)
    model = load_model_source(spec).build_model().train()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6, foreach=False)


def batches():
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 32, (2, 4), generator=generator)
        out.append({"tokens": tokens, "targets": tokens})
    return out


@pytest.mark.parametrize("checkpointing", ["none", "all"])
def test_engine_gathers_foreign_reads_and_matches_torch(profile, checkpointing):
    plan = make_plan(profile, checkpointing)
    assert validate(plan) == []
    assert plan.model.foreign_reads == profile.foreign_reads
    cacheable = sum(not c.resident for c in plan.memory.chunks)
    assert sum(c.offload for c in plan.memory.chunks) > 0 and plan.memory.cache_blocks < cacheable
    reference, ref_opt = build()
    ref_losses = []
    for batch in batches():
        loss = reference(**batch)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss.detach()))
    model, opt = build()
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    losses = []
    for batch in batches():
        loss = model(**batch)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert model.engine.memory_stats()["gathers"] > STEPS * len(plan.memory.chunks)  # evicted and gathered again
    for ours, theirs in zip(losses, ref_losses, strict=True):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs)
    state = model.state_dict()
    for name, value in reference.state_dict().items():
        assert (state[name] - value).abs().max() <= 1e-5, name


def test_a_plan_without_the_record_fails_clearly_at_the_first_step(profile):
    plan = make_plan(profile, "all")
    plan.model.foreign_reads = [read for read in plan.model.foreign_reads if read.module != "blocks.0.mixer"]
    model, opt = build()
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    batch = batches()[0]
    with pytest.raises(
        UngatheredRead, match=r"'blocks\.0\.mixer\.conv\.weight'.*model\.foreign_reads.*elixir-tune profile"
    ):
        model(**batch)


def test_a_read_only_at_run_time_fails_clearly_at_the_first_step():
    runtime = profile_model(RUNTIME_SPEC, batch_size=2, seq_len=4, checkpointing="all")
    plan = make_plan(runtime, "all")
    model, opt = build(RUNTIME_SPEC)
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    with pytest.raises(UngatheredRead, match=r"'blocks\.0\.right\.weight'.*inside the forward of 'blocks\.0\.mixer'"):
        model(**batches()[0])


def test_the_check_runs_until_the_first_backward_only(profile):
    model, opt = build()
    model, opt = elixir_tune.setup(model, opt, plan=make_plan(profile, "none"))
    batch = batches()[0]
    with model.engine.read_check() as guard:
        assert guard is not None  # the first step's forward is checked
    opt.backward(model(**batch))
    opt.step()
    with model.engine.read_check() as guard:
        assert guard is None  # later steps run without it


def test_a_plan_naming_an_unknown_parameter_is_invalid(profile):
    plan = make_plan(profile, "none")
    plan.model.foreign_reads.append(ForeignRead(module="blocks.0.mixer", params=["blocks.0.mixer.nothing"]))
    problems = validate(plan)
    assert any("model.foreign_reads[5].module" in p for p in problems), problems
    assert any("model.foreign_reads[5].params" in p and "blocks.0.mixer.nothing" in p for p in problems), problems
