"""What a pipeline rank holds, decided before any process group exists (engine/parallel/pipeline.py ``prepare``):
virtual stages, this stage's and the shared chunks, the modules of other stages; and the errors for
plans or models the pipeline engine cannot run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elixir_tune.engine.parallel.pipeline_adapters import adapter_for
from elixir_tune.engine.parallel.pipeline_stages import prepare
from elixir_tune.plan.stages import virtual_stages
from tests.distributed.engine_plans import make_plan, tied_net, tiny_gpt2_config


def _gpt2(blocks: int = 4):
    from transformers import GPT2LMHeadModel

    config = tiny_gpt2_config()
    config.n_layer = blocks
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def test_virtual_stages_loop_modular_blocks_and_group_contiguous_ones():
    assert virtual_stages(4, 2, "modular") == [(0, [0]), (1, [1]), (0, [2]), (1, [3])]
    assert virtual_stages(4, 2, "contiguous") == [(0, [0, 1]), (1, [2, 3])]
    assert virtual_stages(5, 2, "contiguous") == [(0, [0, 1, 2]), (1, [3, 4])]


def test_each_stage_keeps_its_blocks_and_the_tied_embedding():
    model = _gpt2()
    plan = make_plan(model, 2, 4096, block_list="transformer.h", stages=2)
    _, first = prepare(model, plan, 0)
    _, last = prepare(model, plan, 1)
    assert first.elsewhere == {"transformer.h.1": 1, "transformer.h.3": 1, "transformer.ln_f": 1}
    assert last.elsewhere == {"transformer.wpe": 0, "transformer.h.0": 0, "transformer.h.2": 0}
    assert first.shared == last.shared == {0: (0, 1)}  # wte, the lm_head's weight too
    first_ids = {chunk.id for chunk in first.plan.memory.chunks}
    last_ids = {chunk.id for chunk in last.plan.memory.chunks}
    assert first_ids & last_ids == {0}
    assert first_ids | last_ids == {chunk.id for chunk in plan.memory.chunks}
    assert all(chunk.stage == 1 for chunk in last.plan.memory.chunks if chunk.id != 0)


def test_a_chunk_mixing_tied_and_untied_parameters_is_refused():
    model = _gpt2()
    plan = make_plan(model, 2, 4096, block_list="transformer.h", stages=2)
    # wte (used by stages 0 and 1) packed with wpe (stage 0 only): valid for validate, not for the engine.
    chunks = plan.memory.chunks
    merged = dataclasses.replace(chunks[0], params=chunks[0].params + chunks[1].params)
    rest = [dataclasses.replace(c, id=i) for i, c in enumerate(chunks[2:], start=1)]
    bad = dataclasses.replace(plan, memory=dataclasses.replace(plan.memory, chunks=[merged, *rest]))
    with pytest.raises(ValueError, match=r"memory.chunks\[0\] holds parameters used on stages \[0, 1\] \(tied\)"):
        prepare(model, bad, 0)


def test_models_without_a_stage_plan_get_a_clear_error():
    with pytest.raises(ValueError, match=r"TiedNet \(no transformers config\) has no pipeline plan"):
        adapter_for(tied_net(), "body")
    with pytest.raises(ValueError, match="split 'transformer.h'"):
        adapter_for(_gpt2(), "transformer.x")


def test_held_gradients_are_reduced_once_per_step_and_stragglers_flushed():
    """No-sync (what a pipeline step uses): three backward passes, one reduction per chunk; a module
    used in one pass only has its gradient flushed at the end; the sums equal plain PyTorch's."""
    import copy

    import elixir_tune
    from tests.distributed.engine_plans import batches

    model = tied_net()
    reference = copy.deepcopy(model)
    plan = make_plan(model, 1, 4096, block_list="body")
    wrapped, _ = elixir_tune.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), plan=plan)
    engine = wrapped.engine
    micro = [{k: v[2 * i : 2 * i + 2] for k, v in batches(1, 6, 8)[0].items()} for i in range(3)]
    engine.hold_grads(3)
    reduced = [engine.grads.reduce_scatters]
    for index, batch in enumerate(micro):
        wrapped.module.use_extra = reference.use_extra = index == 1  # ``extra`` runs in one pass of three
        (wrapped(**batch).loss / 3).backward()
        (reference(**batch).loss / 3).backward()
        reduced.append(engine.grads.reduce_scatters)
    engine.end_held_grads()
    reduced.append(engine.grads.reduce_scatters)
    assert reduced[2] == reduced[0]  # nothing reduced before the last pass
    # Once per chunk; a chunk that also holds ``extra``'s parameters (still held after the last pass)
    # once more, when they are flushed.
    mixed = sum(1 for chunk in engine.chunks if {s.name.startswith("extra.") for s in chunk.slots} == {True, False})
    flushed = sum(1 for chunk in engine.chunks if any(s.name.startswith("extra.") for s in chunk.slots))
    assert reduced[-1] - reduced[0] == len(engine.chunks) + mixed
    assert reduced[-1] - reduced[-2] == flushed
    expected = dict(reference.named_parameters())
    for slot in engine.slots:
        grad = slot.chunk.grad[slot.offset : slot.offset + slot.numel].view(slot.shape)
        want = expected[slot.name].grad
        if want is None:  # ``unused`` never runs: no gradient in torch, zero in the shard
            want = torch.zeros(slot.shape)
        assert torch.allclose(grad, want, rtol=1e-5, atol=1e-7), slot.name
