"""The cost model's corrections from published figures, on hand-computed numbers.

(1) host Adam per rank = min(one process, node / ranks); (2) PCIe-only GPUs share the link between
collectives and host copies; (3) compute at the model-level or measured block rate, not the bare
matmul rate; (4) offload traffic as the engine moves it: uploads and copy-downs in the compute
dtype, host accumulation of arrived gradients overlapped with backward.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.costmodel.parallel import Layout
from elixir_tune.costmodel.synthetic import example_hardware, gpt2_profile
from elixir_tune.costmodel.timeline import TransferCosts, issue_steps, simulate_micro_batch, transfer_costs
from elixir_tune.hardware.spec import interpolate_log

COSTS = TransferCosts(h2d_s=0.1, allgather_s=0.5, reduce_scatter_s=0.25, d2h_s=0.2, grad_norm_s=0.01)


def test_cpu_adam_per_rank_is_capped_by_the_node():
    # DeepSpeed #735: ~1.4e9 elements/s for one process; #6834: ~1.8e9 for a whole 8-GPU node.
    spec = dataclasses.replace(example_hardware(gpus_per_node=8), cpu_adam_elems_per_s=1.4e9)
    spec.cpu_adam_node_elems_per_s = 1.8e9
    assert spec.cpu_adam_rate_per_rank(8) == pytest.approx(1.8e9 / 8)  # 2.25e8
    assert spec.cpu_adam_rate_per_rank(2) == pytest.approx(0.9e9)
    assert spec.cpu_adam_rate_per_rank(1) == pytest.approx(1.4e9)  # one process cannot use the whole node
    # An older file without the node rate: per-rank rate x ranks, i.e. the old per-rank figure.
    spec.cpu_adam_node_elems_per_s = 0.0
    assert spec.cpu_adam_rate_per_rank(8) == pytest.approx(1.4e9)


def test_cost_model_steps_the_host_shards_at_the_per_rank_rate():
    spec = example_hardware(gpus_per_node=8)
    spec.cpu_adam_elems_per_s, spec.cpu_adam_node_elems_per_s = 1.4e9, 1.8e9
    profile = gpt2_profile(hidden=512, layers=4, heads=8, vocab=1024, seq_len=256)
    model = CostModel(profile, spec, gpus_per_node=8)
    assert model.cpu_adam_elems_per_s == pytest.approx(2.25e8)
    chunk = 2**22
    num_chunks = model.layout(chunk).num_chunks
    shape = Shape(chunk, model.layout(chunk).num_cacheable, num_chunks, 1, 0, 1, 1)
    estimate = model.step_time(shape)
    assert estimate.breakdown["optimizer_cpu_s"] == pytest.approx(num_chunks * (chunk // 8) / 2.25e8)


def test_shared_link_serialises_collectives_behind_copy_down():
    # Chunk 0 (offloaded) is reduced after step 0 and copied down while chunk 1 is gathered.
    fetches = [(0, 0, -1), (1, 1, -1)]
    reduce_after = [(0,), (1,)]
    args = ([1.0, 1.0], fetches, issue_steps(fetches, 0), reduce_after, [True, False], COSTS)
    # own links: h2d 0: 0-0.1; gather 0: 0.1-0.6; step 0: 0.6-1.6; reduce 0: 1.6-1.85; d2h 0: 1.85-2.05;
    # gather 1: 1.85-2.35 (the collective stream is free); step 1: 2.35-3.35; reduce 1: 3.35-3.6
    apart = simulate_micro_batch(*args)
    assert apart.compute_end_s == pytest.approx(3.35)
    assert apart.exposed_fetch_s == pytest.approx(0.6 + 0.75)
    assert apart.drained_s == pytest.approx(3.6)
    # shared PCIe: gather 1 needs the outbound link too, busy with d2h 0 until 2.05: 2.05-2.55;
    # step 1: 2.55-3.55; reduce 1: 3.55-3.8
    shared = simulate_micro_batch(*args, shared_link=True)
    assert shared.compute_end_s == pytest.approx(3.55)
    assert shared.exposed_fetch_s == pytest.approx(0.6 + 0.95)
    assert shared.drained_s == pytest.approx(3.8)


def test_shared_link_holds_uploads_behind_a_collective():
    fetches = [(0, 0, -1), (1, 1, -1)]  # chunk 1 offloaded, prefetched during gather 0
    args = ([1.0, 1.0], fetches, issue_steps(fetches, 1), [(), (0, 1)], [False, True], COSTS)
    # own links: gather 0: 0-0.5; h2d 1: 0-0.1; gather 1: 0.5-1.0 (ready 0.1); no wait for step 1
    assert simulate_micro_batch(*args).exposed_fetch_s == pytest.approx(0.5)
    # shared: h2d 1 waits for gather 0 on the inbound link: 0.5-0.6; gather 1: 0.6-1.1, still hidden
    shared = simulate_micro_batch(*args, shared_link=True)
    assert shared.exposed_fetch_s == pytest.approx(0.5)
    assert shared.compute_end_s == pytest.approx(2.5)


def test_cost_model_shares_the_link_only_on_pcie_presets_with_peers():
    profile = gpt2_profile(hidden=256, layers=2, heads=4, seq_len=128)
    spec = example_hardware(gpus_per_node=4)
    assert not CostModel(profile, spec, gpus_per_node=4).shared_link
    spec.shared_host_link = True
    assert CostModel(profile, spec, gpus_per_node=4).shared_link
    assert not CostModel(profile, spec, gpus_per_node=1).shared_link  # world 1: no collectives


def test_interpolate_log_is_log_log_linear_and_clamped():
    curve = {10**6: 1.0, 10**8: 100.0}
    assert interpolate_log(curve, 1e7) == pytest.approx(10.0)  # halfway in log x -> halfway in log y
    assert interpolate_log(curve, 1e5) == 1.0 and interpolate_log(curve, 1e9) == 100.0


def test_compute_runs_at_the_model_rate_then_the_block_curve():
    profile = gpt2_profile(hidden=256, layers=2, heads=4, seq_len=128)
    spec = example_hardware()
    bare = CostModel(profile, spec, gpus_per_node=1, dtype="bf16").compute_s(4, 0)[0]
    assert bare == pytest.approx(4 * profile.flops_per_sample / 200e12)  # the matmul rate, as before
    spec.model_tflops = {"bf16": 170.0}  # A100: a large GPT's forward+backward (llm-foundry)
    model = CostModel(profile, spec, gpus_per_node=1, dtype="bf16")
    assert model.compute_s(4, 0)[0] == pytest.approx(4 * profile.flops_per_sample / 170e12)
    # A measured block curve wins; it is read at the mean block's parameter count.
    params = profile.params
    block = profile.blocks[0]
    numel = sum(p.numel for p in params[block.first_param : block.first_param + block.num_params])
    assert model.block_numel() == numel
    spec.block_tflops_curves = {"bf16": {numel // 10: 10.0, numel * 10: 100.0}}
    model = CostModel(profile, spec, gpus_per_node=1, dtype="bf16")
    expected_tflops = 10 ** (
        1 + (math.log10(numel) - math.log10(numel // 10)) / (math.log10(numel * 10) - math.log10(numel // 10))
    )
    assert model.compute_s(1, 0)[0] == pytest.approx(profile.flops_per_sample / (expected_tflops * 1e12), rel=1e-6)
    assert model.compute_s(4, 0)[0] == pytest.approx(4 * model.compute_s(1, 0)[0])  # no micro-batch effect
    # the fp32 curve stands in for a dtype it lacks only when nothing else names that dtype
    assert spec.compute_tflops("fp16") == 200.0


def test_offload_traffic_moves_the_compute_dtype_and_accumulates_on_the_host():
    spec = example_hardware(gpus_per_node=4)  # cpu Adam 1e9 per process, node derived: 1e9 per rank
    chunk = 2**20
    costs = transfer_costs(spec, chunk, world_size=4, gpus_per_node=4, nodes=1, dtype="bf16")
    shard = chunk // 4
    assert costs.h2d_s == pytest.approx(spec.copy_latency_s + shard * 2 / 12e9)  # bf16, not fp32
    assert costs.d2h_s == pytest.approx(spec.copy_latency_s + shard * 2 / 12e9)
    # host add: read fp32 grad + bf16 shard, write fp32 = 10 B/element at Adam's 28 B/element rate
    assert costs.host_add_s == pytest.approx(shard * 10 / (1e9 * 28))
    spec.cpu_adam_node_elems_per_s = 2e9  # half a process's rate per rank on 4 ranks
    halved = transfer_costs(spec, chunk, world_size=4, gpus_per_node=4, nodes=1, dtype="bf16")
    assert halved.host_add_s == pytest.approx(2 * costs.host_add_s)
    cpu = dataclasses.replace(spec, device="cpu")
    assert transfer_costs(cpu, chunk, 4, 4, 1, "bf16").host_add_s == 0.0  # one memory: nothing to add


def test_host_accumulation_overlaps_backward_and_ends_the_drain():
    costs = dataclasses.replace(COSTS, host_add_s=0.3)
    fetches = [(0, 0, -1), (1, 1, -1)]
    # chunk 0 offloaded, reduced after step 0: d2h 1.85-2.05, host add 2.05-2.35, hidden by step 1
    run = simulate_micro_batch([1.0, 1.0], fetches, [0, 1], [(0,), (1,)], [True, False], costs)
    assert run.drained_s == pytest.approx(3.6)
    # reduced last: reduce 1: 3.1-3.35 ... d2h 1 3.6-3.8, then the host add 3.8-4.1 is exposed
    last = simulate_micro_batch([1.0, 1.0], fetches, [0, 1], [(), (0, 1)], [False, True], costs)
    assert last.drained_s == pytest.approx(4.1)


def test_block_call_overhead_is_added_per_block_call():
    profile = gpt2_profile(hidden=256, layers=4, heads=4, vocab=1024, seq_len=128)
    spec = example_hardware()
    spec.model_tflops = {"bf16": 100.0}
    spec.block_call_overhead_s = 0.002  # 2 ms per block forward+backward, 1 ms per recomputed forward
    model = CostModel(profile, spec, gpus_per_node=1, dtype="bf16")
    flops_s = profile.flops_per_sample / 100e12
    compute, recompute = model.compute_s(2, 0)
    assert compute == pytest.approx(2 * flops_s + 4 * 0.002) and recompute == 0
    # checkpointing every 2nd block: blocks 0 and 2 recompute their forward
    compute, recompute = model.compute_s(2, 2)
    recompute_flops_s = 2 * model.recompute_flops_per_sample(2) / 100e12
    assert recompute == pytest.approx(recompute_flops_s + 2 * 0.001)
    assert compute == pytest.approx(2 * flops_s + 4 * 0.002 + recompute)
    # four micro-batches of 1 pay the overhead four times where one of 4 pays it once
    assert 4 * model.compute_s(1, 0)[0] - model.compute_s(4, 0)[0] == pytest.approx(3 * 4 * 0.002)


def test_pointwise_bytes_are_priced_at_the_pointwise_rate():
    profile = dataclasses.replace(
        gpt2_profile(hidden=256, layers=4, heads=4, vocab=1024, seq_len=128),
        pointwise_bytes_per_sample=3e6,
        recompute_pointwise_bytes_per_sample=1e6,
    )
    spec = example_hardware()
    spec.model_tflops = {"bf16": 100.0}
    without = CostModel(profile, spec, gpus_per_node=1, dtype="bf16")
    spec = dataclasses.replace(spec, pointwise_gbps=10.0)
    model = CostModel(profile, spec, gpus_per_node=1, dtype="bf16")
    # 2 samples x 3 MB at 10 GB/s: 0.6 ms more per micro-batch, none of it recomputation
    assert model.compute_s(2, 0)[0] - without.compute_s(2, 0)[0] == pytest.approx(2 * 3e6 / 10e9)
    assert model.compute_s(2, 0)[1] == without.compute_s(2, 0)[1] == 0
    # every 2nd block recomputes: its share of the 1 MB/sample recomputation's pointwise bytes
    share = model.recompute_share(2)
    assert 0 < share < 1
    extra_recompute = 2 * 1e6 * share / 10e9
    assert model.compute_s(2, 2)[1] - without.compute_s(2, 2)[1] == pytest.approx(extra_recompute)
    assert model.compute_s(2, 2)[0] - without.compute_s(2, 2)[0] == pytest.approx(2 * 3e6 / 10e9 + extra_recompute)


def test_layered_steps_on_the_cpu_pay_a_thread_hand_over_per_module_call():
    profile = gpt2_profile(hidden=256, layers=4, heads=4, vocab=1024, seq_len=128)
    forward_calls = len(profile.trace) // 2  # the trace holds each hooked call forward and backward
    assert forward_calls > 4 * 4  # several per block
    spec = dataclasses.replace(example_hardware(gpus_per_node=2), device="cpu")
    shape = Shape(
        chunk_size=2**20, cache_blocks=4, num_offloaded=0, prefetch=1, every=0, micro_batch_size=2, grad_accum_steps=4
    )
    layered = dataclasses.replace(shape, layered=True)
    free = CostModel(profile, spec, gpus_per_node=2, dtype="fp32")
    paid = CostModel(profile, dataclasses.replace(spec, thread_handoff_s=1e-4), gpus_per_node=2, dtype="fp32")
    estimate = paid.step_time(layered)
    assert estimate.breakdown["thread_handoff_s"] == pytest.approx(4 * forward_calls * 1e-4)
    assert estimate.step_time_s - free.step_time(layered).step_time_s == pytest.approx(4 * forward_calls * 1e-4)
    assert paid.step_time(shape).step_time_s == free.step_time(shape).step_time_s  # standard: one thread
    on_gpu = CostModel(profile, dataclasses.replace(spec, device="cuda", thread_handoff_s=1e-4), 2, dtype="fp32")
    assert "thread_handoff_s" not in on_gpu.step_time(layered).breakdown  # hidden behind the GPU's queue
    # a pipeline orders its micro-batches by its schedule, without threads
    piped = CostModel(profile, paid.hardware, gpus_per_node=2, dtype="fp32", layout=Layout(pipeline=2))
    assert "thread_handoff_s" not in piped.step_time(layered).breakdown
