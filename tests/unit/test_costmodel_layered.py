"""Layered gradient accumulation in the cost model and the search: the step pays one micro-batch's
chunk traffic (fetches, uploads, reductions) for all its micro-batches and holds all their
activations; the search tries it wherever a step has several micro-batches."""

from __future__ import annotations

import pytest

from elixir_tune.costmodel.memory import activation_bytes, untraced_step_bytes
from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.costmodel.synthetic import example_hardware, gpt2_profile
from elixir_tune.search import search
from elixir_tune.search.joint import micro_batch_accumulation_choices
from elixir_tune.search.space import parse_fixed

ACCUM = 4


@pytest.fixture(scope="module")
def model() -> CostModel:
    profile = gpt2_profile("gpt2-small-ish", hidden=256, layers=4, heads=4, vocab=4096, positions=256, seq_len=256)
    return CostModel(profile, example_hardware(gpus_per_node=2), gpus_per_node=2, dtype="bf16")


def shapes(model: CostModel, accum: int, layered: bool, every: int = 0, cache: str = "min") -> Shape:
    chunk_size = model.profile.params[0].numel  # the embedding alone fills a chunk: many chunks
    chunk_size += -chunk_size % (8 * model.world_size)
    layout = model.layout(chunk_size)
    blocks = model.min_cache_blocks(chunk_size, every) if cache == "min" else layout.num_cacheable
    return Shape(chunk_size, blocks, layout.num_chunks, 0, every, 2, accum, layered=layered)


def test_layered_pays_one_micro_batch_of_traffic(model):
    one = model.step_time(shapes(model, 1, False)).breakdown
    standard = model.step_time(shapes(model, ACCUM, False)).breakdown
    layered = model.step_time(shapes(model, ACCUM, True)).breakdown
    costs = model.costs(shapes(model, 1, False).chunk_size)
    # A single micro-batch's traffic, counted in whole transfers.
    gathers = round(one["allgather_s"] / costs.allgather_s)
    reduces = round(one["reduce_scatter_s"] / costs.reduce_scatter_s)
    assert reduces == model.layout(shapes(model, 1, False).chunk_size).num_chunks  # every chunk once
    assert gathers > reduces  # a small cache: chunks are fetched again in backward
    # Layered: exactly that traffic for four micro-batches; standard: four times the reductions.
    assert layered["allgather_s"] == pytest.approx(gathers * costs.allgather_s)
    assert layered["reduce_scatter_s"] == pytest.approx(reduces * costs.reduce_scatter_s)
    assert layered["h2d_s"] == pytest.approx(gathers * costs.h2d_s)  # every chunk offloaded
    assert layered["d2h_s"] == pytest.approx(reduces * costs.d2h_s)
    assert standard["reduce_scatter_s"] == pytest.approx(ACCUM * reduces * costs.reduce_scatter_s)
    assert standard["allgather_s"] > 3 * layered["allgather_s"]
    # The same compute either way: four micro-batches.
    assert layered["compute_s"] == pytest.approx(standard["compute_s"]) == pytest.approx(ACCUM * one["compute_s"])


def test_layered_is_faster_when_offloaded_traffic_dominates(model):
    standard = model.step_time(shapes(model, ACCUM, False)).step_time_s
    layered = model.step_time(shapes(model, ACCUM, True)).step_time_s
    assert layered < standard


def test_layered_recomputes_once_per_micro_batch(model):
    """Checkpointed blocks run their forward and their recomputation one micro-batch at a time (so
    that the recomputation draws the forward's random numbers): with a cache smaller than a block's
    chunks each micro-batch fetches them again; with every chunk cached, nothing is refetched."""
    costs = model.costs(shapes(model, 1, False).chunk_size)

    def gathers(shape: Shape) -> int:
        return round(model.step_time(shape).breakdown["allgather_s"] / costs.allgather_s)

    one = gathers(shapes(model, 1, False, every=1))
    two = gathers(shapes(model, 2, True, every=1))
    layered = gathers(shapes(model, ACCUM, True, every=1))
    recompute_refetch = two - one  # what one more micro-batch's block forwards and recomputations fetch
    assert recompute_refetch > 0
    assert layered == one + (ACCUM - 1) * recompute_refetch
    assert layered <= gathers(shapes(model, ACCUM, False, every=1))
    assert gathers(shapes(model, ACCUM, True, every=1, cache="all")) == gathers(
        shapes(model, 1, False, every=1, cache="all")
    )


def test_layered_holds_every_micro_batch_activations(model):
    standard, layered = shapes(model, ACCUM, False, every=1), shapes(model, ACCUM, True, every=1)
    one = activation_bytes(model.profile, 2, 1, "bf16")
    # ... and each held micro-batch's tokens and its checkpointed blocks' saved generator states
    untraced = untraced_step_bytes(model.profile, 2, 1, 2) - untraced_step_bytes(model.profile, 2, 1, 1)
    difference = model.memory(layered).peak_gpu_bytes - model.memory(standard).peak_gpu_bytes
    assert difference == (ACCUM - 1) * (one + untraced)
    assert model.memory(layered).activation_bytes == ACCUM * one


def test_with_one_micro_batch_layered_is_standard(model):
    for every in (0, 1):
        assert model.step_time(shapes(model, 1, True, every)) == model.step_time(shapes(model, 1, False, every))
        assert model.memory(shapes(model, 1, True, every)) == model.memory(shapes(model, 1, False, every))


def test_search_choices_and_the_pin():
    assert micro_batch_accumulation_choices(4, {}) == [(4, False), (2, False), (2, True), (1, False), (1, True)]
    assert micro_batch_accumulation_choices(4, {"accumulation": "layered"}) == [(2, True), (1, True)]
    with pytest.raises(ValueError, match="layered accumulation needs several"):
        micro_batch_accumulation_choices(4, {"accumulation": "layered", "micro_batch_size": 4})
    assert parse_fixed(["accumulation=layered"]) == {"accumulation": "layered"}
    with pytest.raises(ValueError, match="expected one of standard, layered"):
        parse_fixed(["accumulation=looped"])


def test_pinned_layered_search_writes_it_into_the_plan():
    profile = gpt2_profile("gpt2-tiny", hidden=128, layers=2, heads=2, vocab=1024, positions=128, seq_len=128)
    node = example_hardware(gpus_per_node=2)
    result = search(
        profile, node, gpus_per_node=2, global_batch_size=16, fixed=["accumulation=layered"], loop="forward_backward"
    )
    assert result.plan.training.accumulation == "layered"
    assert result.plan.training.grad_accum_steps > 1
    assert "layer by layer" in result.why
    standard = search(
        profile, node, gpus_per_node=2, global_batch_size=16, fixed=["accumulation=standard"], loop="forward_backward"
    )
    assert standard.plan.training.accumulation == "standard"
