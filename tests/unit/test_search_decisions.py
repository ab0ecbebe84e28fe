"""Decisions of the search and the timeline that a fast test must pin down: reversing one of them
(trying only the smallest offload share that fits; letting all-gathers leave the host links free on
PCIe-only nodes) makes a test here fail."""

from __future__ import annotations

import dataclasses

import pytest

from elixir_tune.costmodel.memory import SHARD_BYTES
from elixir_tune.costmodel.synthetic import example_hardware, gpt2_profile
from elixir_tune.costmodel.timeline import TransferCosts, simulate_micro_batch
from elixir_tune.search import search
from elixir_tune.search.candidate import score


def test_the_search_offloads_more_than_it_must_when_that_is_faster():
    # A GPU whose Adam is 4x slower than the host's: spreading the optimizer over both is faster
    # than keeping every shard that fits on the GPU, so the best plan offloads far more than the
    # smallest share that fits (the search tries a grid of shares above it, not only that one).
    node = example_hardware(gpus_per_node=2)
    node = dataclasses.replace(node, gpu_adam_elems_per_s=node.cpu_adam_elems_per_s / 4)
    result = search(gpt2_profile("gpt2-4b"), node, gpus_per_node=2, fixed=["pipeline=1", "tensor=1"])
    best, model = result.candidates[0], result.model
    at_zero = model.memory(dataclasses.replace(best.shape, num_offloaded=0))
    shard_bytes = best.shape.chunk_size // model.data_size * SHARD_BYTES
    smallest = max(0, -(-(at_zero.required_gpu_bytes - result.usable_gpu_bytes) // shard_bytes))
    assert best.shape.num_offloaded >= smallest + 5
    least = dataclasses.replace(best.shape, num_offloaded=smallest)
    slower = score(model, least, model.memory(least), result.plan.training.global_batch_size)
    assert slower.step_time_s > 1.2 * best.step_time_s


COSTS = TransferCosts(h2d_s=0.1, allgather_s=0.5, reduce_scatter_s=0.25, d2h_s=0.2, grad_norm_s=0.0)


def test_on_a_pcie_node_an_all_gather_holds_the_host_links():
    # Chunk 0 (on the GPU) and chunk 1 (offloaded) are both fetched for step 0. Without NVLink the
    # gather of chunk 0 crosses the GPU's PCIe link both ways, so the upload of chunk 1 waits for it:
    # gather 0: 0-0.5; upload 1: 0.5-0.6; gather 1: 0.6-1.1; step 0: 1.1-2.1.
    fetches = [(0, 0, -1), (0, 1, -1)]
    args = ([1.0], fetches, [0, 0], [()], [False, True], COSTS)
    shared = simulate_micro_batch(*args, shared_link=True)
    assert shared.compute_end_s == pytest.approx(2.1)
    # With NVLink the upload runs beside the gather: gather 1 starts when gather 0 ends (0.5-1.0).
    apart = simulate_micro_batch(*args)
    assert apart.compute_end_s == pytest.approx(2.0)


def test_on_a_pcie_node_an_all_gather_waits_for_a_copy_down_on_its_link():
    # After step 0, chunk 1 (offloaded) is reduced and copied down; the gather for step 1, issued at
    # its hook, crosses the same link, so it waits for the copy-down:
    # gather 0: 0-0.5; step 0: 0.5-1.5; reduce 1: 1.5-1.75; copy-down 1: 1.75-1.95;
    # gather 2: 1.95-2.45; step 1: 2.45-3.45.
    fetches = [(0, 0, -1), (1, 2, -1)]
    args = ([1.0, 1.0], fetches, [0, 1], [(1,), ()], [False, True, False], COSTS)
    assert simulate_micro_batch(*args, shared_link=True).compute_end_s == pytest.approx(3.45)
    # With NVLink the gather runs beside the copy-down: 1.75-2.25, step 1: 2.25-3.25.
    assert simulate_micro_batch(*args).compute_end_s == pytest.approx(3.25)
