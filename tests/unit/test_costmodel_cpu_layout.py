"""The CPU layout ratios (hardware/bench_layout.py): the spec's fields, their checks, and how the cost
model prices a tensor split and a pipeline with them on a CPU device (costmodel/parallel_time.py)."""

from __future__ import annotations

import dataclasses

import pytest

from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.costmodel.parallel import Layout
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware.presets import load_hardware, spec_problems
from elixir_tune.hardware.spec import HardwareSpec
from elixir_tune.plan.schema import DTYPE_BYTES


@pytest.fixture(scope="module")
def profile():
    return gpt2_profile("p", hidden=64, layers=4, heads=4, vocab=256, positions=32, seq_len=32)


@pytest.fixture(scope="module")
def cpu() -> HardwareSpec:
    return load_hardware("cpu")


def _shape(model: CostModel, micro_batch_size: int, accum: int) -> Shape:
    chunk = sum(p.numel for p in model.full_profile.params)  # one chunk: the whole model
    return Shape(
        chunk_size=chunk,
        cache_blocks=1,
        prefetch=1,
        num_offloaded=0,
        every=0,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=accum,
    )


def test_spec_fields_default_to_unmeasured_and_round_trip(cpu):
    bare = dataclasses.replace(cpu, tensor2_block_extra_ratio=0.0, pipeline_microbatch_extra_ratio=0.0)
    fields = {f.name: f.default for f in dataclasses.fields(HardwareSpec)}
    assert fields["tensor2_block_extra_ratio"] == 0.0 and fields["pipeline_microbatch_extra_ratio"] == 0.0
    again = HardwareSpec.from_dict(cpu.to_dict())
    assert again.tensor2_block_extra_ratio == cpu.tensor2_block_extra_ratio > 0
    assert again.pipeline_microbatch_extra_ratio == cpu.pipeline_microbatch_extra_ratio > 0
    assert "bench_layout" in cpu.sources["tensor2_block_extra_ratio"]
    assert spec_problems(bare) == []


@pytest.mark.parametrize("value", [-0.1, 120.0, "x"])
def test_a_bad_ratio_is_a_problem(cpu, value):
    spec = dataclasses.replace(cpu, pipeline_microbatch_extra_ratio=value)
    assert any(p.startswith("pipeline_microbatch_extra_ratio: expected a ratio") for p in spec_problems(spec))


@pytest.mark.parametrize("value", [-0.001, 2.0, "x"])
def test_a_bad_fixed_cost_is_a_problem(cpu, value):
    spec = dataclasses.replace(cpu, pipeline_stage_microbatch_s=value, tensor2_block_fixed_s=value)
    problems = spec_problems(spec)
    assert any(p.startswith("pipeline_stage_microbatch_s: expected seconds") for p in problems)
    assert any(p.startswith("tensor2_block_fixed_s: expected seconds") for p in problems)


def test_bench_layout_separates_a_fixed_cost_from_a_share():
    from elixir_tune.hardware.bench_layout import STAGE_MICRO_BATCHES, _shares

    def times(plain_s: float, micro_s: float) -> dict[str, float]:
        # A tensor block: 3 ms + (1/2 + 0.2) x plain; a stage micro-batch: 2 ms + (1 + 0.1) x micro.
        stage_s = 0.002 + 1.1 * micro_s
        return {
            "plain_block_s": plain_s,
            "micro_batch_s": micro_s,
            "tensor2_block_s": 0.003 + 0.7 * plain_s,
            "pipeline2_s": STAGE_MICRO_BATCHES * stage_s + micro_s,
        }

    shares = _shares(times(0.04, 0.01), times(0.001, 0.0005))
    assert shares["tensor2_block_fixed_s"] == pytest.approx(0.003)
    assert shares["tensor2_block_extra_ratio"] == pytest.approx(0.2)
    assert shares["pipeline_stage_microbatch_s"] == pytest.approx(0.002)
    assert shares["pipeline_microbatch_extra_ratio"] == pytest.approx(0.1)
    # Without a tiny shape the whole extra is a share of the main shape's time, as before.
    alone = _shares(times(0.04, 0.01), {})
    assert alone["tensor2_block_fixed_s"] == 0.0
    assert alone["tensor2_block_extra_ratio"] == pytest.approx((0.003 + 0.7 * 0.04 - 0.02) / 0.04)


def test_pipeline_sends_on_the_cpu_are_a_fixed_cost_per_stage_micro_batch_and_a_share(profile, cpu):
    measured = dataclasses.replace(cpu, pipeline_stage_microbatch_s=0.004, pipeline_microbatch_extra_ratio=0.1)
    model = CostModel(profile, measured, gpus_per_node=2, layout=Layout(pipeline=2))
    mb_compute, _ = model.compute_s(4, 0)
    breakdown = model.step_time(_shape(model, 4, 4)).breakdown
    # 4 blocks on 2 stages, modular: 2 virtual stages per rank, each for 4 micro-batches.
    p2p_s = 0.004 * 4 * 2 + 0.1 * mb_compute * 4
    assert breakdown["p2p_s"] == pytest.approx(p2p_s)
    # The bubble's idle slots are slots of the busy time, sends and schedule included:
    # (P - 1) / (N v + P - 1) = 1 / 9 of the step.
    assert breakdown["pipeline_bubble_s"] == pytest.approx((mb_compute * 4 + p2p_s) / 8)
    # Twice the micro-batches at half the size: the same compute, twice the fixed costs.
    twice = model.step_time(_shape(model, 2, 8)).breakdown
    assert twice["p2p_s"] - 0.1 * model.compute_s(2, 0)[0] * 8 == pytest.approx(2 * 0.004 * 4 * 2)
    # Unmeasured: back to the link-priced sends, which differ.
    bare = dataclasses.replace(cpu, pipeline_microbatch_extra_ratio=0.0, pipeline_stage_microbatch_s=0.0)
    linked = CostModel(profile, bare, gpus_per_node=2, layout=Layout(pipeline=2)).step_time(_shape(model, 4, 4))
    assert linked.breakdown["p2p_s"] != pytest.approx(breakdown["p2p_s"])
    assert linked.breakdown["pipeline_bubble_s"] == pytest.approx(mb_compute * 4 / 8)


def test_a_tensor_split_on_the_cpu_costs_the_measured_share_of_the_plain_block(profile, cpu):
    layout = Layout(tensor=2)
    model = CostModel(profile, cpu, gpus_per_node=2, layout=layout)
    costs = model.parallel_costs
    plain_s = costs.plain_block_s(8)
    block = profile.blocks[0]
    expected_plain = (
        8 * 3 * block.fwd_flops_per_sample / (cpu.compute_tflops(model.dtype, costs.full_block_numel()) * 1e12)
        + cpu.block_call_overhead_s
    )
    assert plain_s == pytest.approx(expected_plain)
    without_blocks = costs.tensor_comm_s(8, 0, 0)  # the edge collectives alone
    with_blocks = costs.tensor_comm_s(8, len(profile.blocks), 0)
    assert with_blocks - without_blocks == pytest.approx(
        len(profile.blocks) * (cpu.tensor2_block_fixed_s + cpu.tensor2_block_extra_ratio * plain_s)
    )
    # Every collective of the split is inside the measured cost (none outside the blocks) but the bytes
    # of the logits' all-gather (micro-batch x seq x vocab, half of them through each of 2 ranks) and of
    # the 4 edge collectives (micro-batch x seq x hidden, half each), which grow with the model where the
    # probe's run had next to none; unmeasured, the blocks' norm-gradient all-reduces are link-priced.
    logits_bytes = 8 * profile.seq_len * profile.arch.vocab_size * DTYPE_BYTES[model.dtype] / 2
    edge_bytes = 4 * 8 * profile.seq_len * profile.arch.hidden_size * DTYPE_BYTES[model.dtype] / 2
    link_bps = cpu.allgather_gbps * 1e9
    assert without_blocks > 0 and without_blocks == pytest.approx((logits_bytes + edge_bytes) / link_bps)
    assert costs.block_norms_s > 0
    bare = dataclasses.replace(cpu, tensor2_block_extra_ratio=0.0, tensor2_block_fixed_s=0.0)
    linked = CostModel(profile, bare, gpus_per_node=2, layout=layout).parallel_costs
    linked_blocks_s = linked.tensor_comm_s(8, len(profile.blocks), 0) - linked.tensor_comm_s(8, 0, 0)
    assert linked_blocks_s == pytest.approx(len(profile.blocks) * (linked.tensor_layer_s(8)[0] + linked.block_norms_s))
    # Doubling the ratio adds exactly one more share per block and micro-batch to the step.
    doubled = dataclasses.replace(cpu, tensor2_block_extra_ratio=2 * cpu.tensor2_block_extra_ratio)
    shape = _shape(model, 8, 1)
    step_s = model.step_time(shape).step_time_s
    doubled_s = CostModel(profile, doubled, gpus_per_node=2, layout=layout).step_time(shape).step_time_s
    assert doubled_s - step_s == pytest.approx(len(profile.blocks) * cpu.tensor2_block_extra_ratio * plain_s)
    # The rank's compute is read at the whole block's rate (the ratio covers the narrower matrices).
    assert model.flops_per_s_at(8) == pytest.approx(cpu.compute_tflops(model.dtype, costs.full_block_numel()) * 1e12)


def test_a_tensor_split_pays_its_fixed_cost_per_block_and_micro_batch(profile, cpu):
    layout = Layout(tensor=2)
    fixed = dataclasses.replace(cpu, tensor2_block_fixed_s=0.01)
    none = dataclasses.replace(cpu, tensor2_block_fixed_s=0.0)
    for micro_batch_size, accum in ((8, 1), (2, 4)):
        a = CostModel(profile, fixed, gpus_per_node=2, layout=layout)
        b = CostModel(profile, none, gpus_per_node=2, layout=layout)
        shape = _shape(a, micro_batch_size, accum)
        extra_s = a.step_time(shape).step_time_s - b.step_time(shape).step_time_s
        assert extra_s == pytest.approx(0.01 * len(profile.blocks) * accum)


def test_the_ratios_do_not_apply_to_a_gpu(profile):
    gpu = load_hardware("a100-80gb-sxm")
    measured = dataclasses.replace(
        gpu,
        tensor2_block_extra_ratio=5.0,
        pipeline_microbatch_extra_ratio=5.0,
        tensor2_block_fixed_s=0.1,
        pipeline_stage_microbatch_s=0.1,
    )
    for layout in (Layout(tensor=2), Layout(pipeline=2)):
        a = CostModel(profile, gpu, gpus_per_node=8, layout=layout)
        b = CostModel(profile, measured, gpus_per_node=8, layout=layout)
        shape = _shape(a, 4, 4)
        assert a.step_time(shape).step_time_s == pytest.approx(b.step_time(shape).step_time_s)
