"""The step timeline on hand-computed cases, and the per-chunk costs from the hardware numbers."""

from __future__ import annotations

import dataclasses

import pytest

from elixir_tune.costmodel.synthetic import example_hardware
from elixir_tune.costmodel.timeline import (
    TransferCosts,
    combine_step,
    issue_steps,
    micro_batches,
    simulate_micro_batch,
    transfer_costs,
)

COSTS = TransferCosts(h2d_s=0.1, allgather_s=0.5, reduce_scatter_s=0.25, d2h_s=0.2, grad_norm_s=0.01)
FETCHES = [(0, 0, -1), (1, 1, -1)]  # chunk 0 before step 0, chunk 1 (offloaded) before step 1
REDUCE_AFTER = [(), (0, 1)]


def test_without_prefetch_every_fetch_is_exposed():
    run = simulate_micro_batch([1.0, 1.0], FETCHES, issue_steps(FETCHES, 0), REDUCE_AFTER, [False, True], COSTS)
    # gather 0: 0-0.5; step 0: 0.5-1.5; h2d 1: 1.5-1.6; gather 1: 1.6-2.1; step 1: 2.1-3.1;
    # reduce 0: 3.1-3.35; reduce 1: 3.35-3.6; d2h 1: 3.6-3.8
    assert run.compute_end_s == pytest.approx(3.1)
    assert run.exposed_fetch_s == pytest.approx(1.1)
    assert run.drained_s == pytest.approx(3.8)
    assert (run.h2d_s, run.d2h_s, run.allgather_s, run.reduce_scatter_s) == pytest.approx((0.1, 0.2, 1.0, 0.5))


def test_prefetch_overlaps_the_next_fetch_with_compute():
    issue = issue_steps(FETCHES, 1)
    assert issue == [0, 0]
    run = simulate_micro_batch([1.0, 1.0], FETCHES, issue, REDUCE_AFTER, [False, True], COSTS)
    assert run.exposed_fetch_s == pytest.approx(0.5)
    assert run.compute_end_s == pytest.approx(2.5)
    assert run.drained_s == pytest.approx(3.2)


def test_prefetch_waits_for_the_evicted_block():
    fetches = [(0, 0, -1), (1, 1, -1), (3, 2, 1)]  # chunk 2 replaces chunk 1, last used at step 1
    assert issue_steps(fetches, 2) == [0, 0, 2]


def test_step_adds_accumulation_and_optimizer():
    cold = simulate_micro_batch([1.0, 1.0], FETCHES, [0, 1], REDUCE_AFTER, [False, True], COSTS)
    steady = simulate_micro_batch([1.0, 1.0], [], [], REDUCE_AFTER, [False, True], COSTS)
    step, parts = combine_step(
        [cold, steady, steady], COSTS, gpu_adam_s=0.3, cpu_adam_s=0.7, compute_s=6.0, recompute_s=0.0
    )
    # cold compute 3.1, one steady compute 2.0, last steady drained 2.0+0.5+0.2, norm 0.01, slower Adam 0.7
    assert step == pytest.approx(3.1 + 2.0 + 2.7 + 0.01 + 0.7)
    assert parts["grad_drain_s"] == pytest.approx(0.7)
    serial, _ = combine_step([cold], COSTS, 0.3, 0.7, 2.0, 0.0, serial_optimizers=True)
    assert serial == pytest.approx(3.8 + 0.01 + 1.0)


def test_transfer_costs_from_bandwidths():
    spec = example_hardware(gpus_per_node=4)
    chunk = 2**20
    costs = transfer_costs(spec, chunk, world_size=4, gpus_per_node=4, nodes=1, dtype="bf16")
    wire_s = chunk * 2 * 3 / 4 / (spec.allgather_gbps * 1e9)
    cast_s = chunk // 4 * 6 / (spec.hbm_gbps * 1e9)
    assert costs.allgather_s == pytest.approx(spec.collective_latency_s + wire_s + cast_s)
    assert costs.h2d_s == pytest.approx(spec.copy_latency_s + chunk // 4 * 2 / (spec.h2d_gbps_all * 1e9))
    across = transfer_costs(spec, chunk, world_size=8, gpus_per_node=4, nodes=2, dtype="bf16")
    assert across.allgather_s > costs.allgather_s  # inter-node bandwidth is lower
    alone = transfer_costs(spec, chunk, world_size=1, gpus_per_node=1, nodes=1, dtype="bf16")
    assert alone.grad_norm_s == 0 and alone.allgather_s == pytest.approx(chunk * 6 / (spec.hbm_gbps * 1e9))


def test_on_a_cpu_device_collectives_do_not_overlap_compute():
    issue = issue_steps(FETCHES, 1)  # prefetch cannot hide a gather that runs on the compute cores
    run = simulate_micro_batch([1.0, 1.0], FETCHES, issue, REDUCE_AFTER, [False, True], COSTS, shared_compute=True)
    # gather 0: 0-0.5; h2d 1: 0.5-0.6 (own copy resource); gather 1: 0.6-1.1; step 0: 1.1-2.1;
    # step 1: 2.1-3.1; reduce 0: 3.1-3.35; reduce 1: 3.35-3.6; d2h 1: 3.6-3.8
    assert run.exposed_fetch_s == pytest.approx(1.1)
    assert run.compute_end_s == pytest.approx(3.6)
    assert run.drained_s == pytest.approx(3.8)
    overlapped = simulate_micro_batch([1.0, 1.0], FETCHES, issue, REDUCE_AFTER, [False, True], COSTS)
    assert overlapped.drained_s < run.drained_s


def _reduce_bound_step(num_micro: int, step_s: float) -> tuple[float, dict[str, float], int]:
    """A step whose micro-batches each compute ``2 x step_s`` and then reduce two chunks (0.25 s
    each, nothing fetched): (step time, breakdown, micro-batches actually simulated)."""
    simulated = []

    def steady(busy):
        run = simulate_micro_batch([step_s, step_s], [], [], REDUCE_AFTER, [False, False], COSTS, busy_s=busy)
        simulated.append(run)
        return run

    cold = simulate_micro_batch([step_s, step_s], [], [], REDUCE_AFTER, [False, False], COSTS)
    parts = micro_batches(cold, num_micro, steady)
    assert len(parts) == num_micro
    step, breakdown = combine_step(parts, COSTS, 0.0, 0.0, 2 * step_s * num_micro, 0.0)
    return step, breakdown, 1 + len(simulated)


def test_reductions_left_by_one_micro_batch_keep_the_link_busy_into_the_next():
    # Each micro-batch computes 0.2 s and then reduces for 0.5 s: the reductions queue up on the
    # collective stream (0.2-0.7, 0.7-1.2, 1.2-1.7, 1.7-2.2) while the compute runs ahead, so the step
    # ends when the last one drains: 2.2 s + the norm. Starting each micro-batch with free links would
    # predict 0.6 + 0.7 = 1.3 s, less than the 2.0 s the reductions alone take.
    step, breakdown, simulated = _reduce_bound_step(4, 0.1)
    assert breakdown["reduce_scatter_s"] == pytest.approx(2.0)
    assert step == pytest.approx(2.2 + COSTS.grad_norm_s)
    assert step >= breakdown["reduce_scatter_s"]
    assert simulated == 4  # the backlog grows every micro-batch: never periodic


def test_a_periodic_micro_batch_is_simulated_once_and_repeated():
    # Compute 2 s, reductions 0.5 s after it: each micro-batch starts with the same leftover (the
    # previous one's 0.5 s of reductions), so the second is simulated and the rest are copies of it.
    step, _breakdown, simulated = _reduce_bound_step(10, 1.0)
    assert simulated == 2
    assert step == pytest.approx(10 * 2.0 + 0.5 + COSTS.grad_norm_s)


def test_a_growing_backlog_is_extrapolated_and_equals_the_whole_simulation():
    # Compute 0.2 s, reductions 0.5 s: the collective backlog grows by 0.3 s every micro-batch, so the
    # step ends when the last of 100 micro-batches' reductions drain: 0.2 + 100 x 0.5 s. A handful are
    # simulated (cold, two steady ones that show the growth, the last one that checks it), not 100.
    step, breakdown, simulated = _reduce_bound_step(100, 0.1)
    assert step == pytest.approx(0.2 + 100 * 0.5 + COSTS.grad_norm_s)
    assert breakdown["reduce_scatter_s"] == pytest.approx(50.0)
    assert simulated <= 5
    for num_micro in (5, 6, 17):
        exact = 0.2 + num_micro * 0.5 + COSTS.grad_norm_s
        assert _reduce_bound_step(num_micro, 0.1)[0] == pytest.approx(exact)


def test_collectives_beside_compute_slow_it_by_the_compute_loss():
    lossy = TransferCosts(
        h2d_s=0.1, allgather_s=0.5, reduce_scatter_s=0.25, d2h_s=0.2, grad_norm_s=0.01, compute_loss=0.4
    )
    # No prefetch: each gather's loss (0.2) is charged at its hook and absorbed by the wait for it;
    # the two reduce-scatters after step 1 run beside nothing exposed, so they add 0.4 x 0.5.
    run = simulate_micro_batch([1.0, 1.0], FETCHES, issue_steps(FETCHES, 0), REDUCE_AFTER, [False, True], lossy)
    assert run.compute_end_s == pytest.approx(3.1 + 0.2)
    assert run.exposed_fetch_s == pytest.approx(1.1 - 0.4)
    # Prefetch 1: both gathers (1.0 s) are charged at step 0's hook; 0.1 of the 0.5 wait is left.
    run = simulate_micro_batch([1.0, 1.0], FETCHES, issue_steps(FETCHES, 1), REDUCE_AFTER, [False, True], lossy)
    assert run.exposed_fetch_s == pytest.approx(0.1)
    assert run.compute_end_s == pytest.approx(2.5 + 0.2)
    assert run.compute_loss_s == pytest.approx(0.4 * 1.5)


def test_the_compute_loss_is_the_hardware_s_with_more_than_one_rank():
    hardware = dataclasses.replace(example_hardware(), collective_compute_loss=0.5)
    assert transfer_costs(hardware, 1 << 20, 4, 4, 1, "bf16").compute_loss == 0.5
    assert transfer_costs(hardware, 1 << 20, 1, 1, 1, "bf16").compute_loss == 0.0
