"""The compute rates that depend on the model's shapes, and the plausibility bound on a step.

(1) narrow blocks compute slower than wide ones (the block curve), long sequences slower than
short ones (the attention products at their own rate), recomputation is the recomputed FLOPs at
the same rates; (2) a prediction faster than the best published MFU, the host link or the host
Adam allow is raised to the bound and the breakdown says which binds; (3) chunk padding is counted,
and the search adds chunk sizes that pack the model with less of it.
"""

from __future__ import annotations

import dataclasses

import pytest

from elixir_tune.costmodel.layout import largest_trainable_numel, pack_chunks
from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.costmodel.parallel import Layout
from elixir_tune.costmodel.rates import (
    attention_flops_share,
    attention_scores_bytes,
    binding_bound,
    plausibility_bound,
)
from elixir_tune.costmodel.synthetic import example_hardware, gpt2_profile
from elixir_tune.hardware.presets import spec_problems
from elixir_tune.profiler.arch import model_arch
from elixir_tune.search.joint import chunk_sizes
from elixir_tune.search.space import chunk_size_grid, even_split_sizes


def _spec(**changes):
    spec = example_hardware(gpus_per_node=8)
    spec.matmul_peak_tflops = {"bf16": 312.0}
    spec.block_tflops_curves = {"bf16": {10**6: 100.0, 10**8: 200.0}}
    spec.attention_tflops = {"bf16": 50.0}
    return dataclasses.replace(spec, **changes)


def _rate(profile, spec) -> float:
    """Useful FLOP/s of one micro-batch's compute without checkpointing."""
    model = CostModel(profile, spec, gpus_per_node=8)
    compute_s, recompute_s = model.compute_s(1, 0)
    assert recompute_s == 0
    return profile.flops_per_sample / compute_s


def test_attention_share_is_four_seq_squared_hidden_per_layer():
    profile = gpt2_profile(hidden=256, layers=2, heads=4, vocab=1000, seq_len=512)
    attention = 3 * 2 * 4 * 512**2 * 256
    assert attention_flops_share(profile) == pytest.approx(attention / profile.flops_per_sample)


def test_narrow_blocks_and_long_sequences_compute_slower():
    spec = _spec()
    flash = {"flash_attention": True}  # fused attention: its FLOPs at the attention rate, nothing else
    narrow = gpt2_profile(hidden=256, layers=2, heads=4, vocab=1000, seq_len=512, **flash)  # 0.8M per block
    wide = gpt2_profile(hidden=2048, layers=2, heads=16, vocab=1000, seq_len=512, **flash)  # 50M per block
    assert _rate(narrow, spec) < _rate(wide, spec)
    short = gpt2_profile(hidden=2048, layers=2, heads=16, vocab=1000, seq_len=512, **flash)
    long = gpt2_profile(hidden=2048, layers=2, heads=16, vocab=1000, seq_len=8192, positions=8192, **flash)
    assert _rate(long, spec) < _rate(short, spec)
    # Split exactly: matmul FLOPs at the block curve, attention FLOPs at 50 TFLOP/s.
    model = CostModel(long, spec, gpus_per_node=8)
    share = attention_flops_share(long)
    block_rate = spec.compute_tflops("bf16", model.block_numel()) * 1e12
    expected = long.flops_per_sample * ((1 - share) / block_rate + share / 50e12)
    assert model.compute_s(1, 0)[0] == pytest.approx(expected)
    # Without an attention rate every FLOP runs at the block rate (one rate, as before).
    flat = CostModel(long, _spec(attention_tflops={}), gpus_per_node=8)
    assert flat.compute_s(1, 0)[0] == pytest.approx(long.flops_per_sample / block_rate)


def test_recomputation_is_the_extra_forward_at_the_same_rates():
    spec = _spec()
    profile = gpt2_profile(
        hidden=1024, layers=4, heads=8, vocab=1000, seq_len=2048, positions=2048, flash_attention=True
    )
    model = CostModel(profile, spec, gpus_per_node=8)
    plain, _ = model.compute_s(2, 0)
    checkpointed, recompute = model.compute_s(2, 1)
    assert checkpointed - plain == pytest.approx(recompute)
    block_rate = spec.compute_tflops("bf16", model.block_numel()) * 1e12
    blocks_forward = sum(b.fwd_flops_per_sample for b in profile.blocks)
    attention_forward = attention_flops_share(profile) * profile.flops_per_sample / 3
    expected = 2 * ((blocks_forward - attention_forward) / block_rate + attention_forward / 50e12)
    assert recompute == pytest.approx(expected)


def test_eager_attention_moves_its_scores_through_hbm():
    """Scores written by an eager attention cost (6b + 1) bytes per element forward and (9b + 1)
    backward at the HBM rate, again in a recomputed forward, and raise the compute bound."""
    spec = _spec(best_mfu={"bf16": 0.01})
    sizes = {"hidden": 1024, "layers": 4, "heads": 8, "vocab": 1000, "seq_len": 2048, "positions": 2048}
    eager, fused = gpt2_profile(**sizes), gpt2_profile(**sizes, flash_attention=True)
    assert eager.arch.attention_scores and not fused.arch.attention_scores
    elements = 4 * 8 * 2048**2
    assert attention_scores_bytes(eager, "bf16") == (elements * 13, elements * 19)
    assert attention_scores_bytes(fused, "bf16") == (0.0, 0.0)
    eager_model, fused_model = (CostModel(p, spec, gpus_per_node=8) for p in (eager, fused))
    hbm = spec.hbm_gbps * 1e9
    for every in (0, 1):
        (eager_s, eager_re), (fused_s, fused_re) = eager_model.compute_s(3, every), fused_model.compute_s(3, every)
        assert eager_re - fused_re == pytest.approx(3 * elements * 13 / hbm * every)
        assert eager_s - fused_s == pytest.approx(3 * elements * (32 + 13 * every) / hbm)
    # The best MFU was published with fused attention: the score traffic adds to the compute bound.
    shape = Shape(2**22, eager_model.layout(2**22).num_cacheable, 0, 1, 0, 8, 1)
    eager_bound = eager_model.step_time(shape).breakdown["bound_compute_s"]
    fused_bound = fused_model.step_time(shape).breakdown["bound_compute_s"]
    assert eager_bound - fused_bound == pytest.approx(8 * elements * 32 / hbm)
    # A tensor shard moves its FLOPs' share of the scores (half the heads at degree 2).
    halves = CostModel(eager, spec, gpus_per_node=8, layout=Layout(tensor=2))
    fused_halves = CostModel(fused, spec, gpus_per_node=8, layout=Layout(tensor=2))
    scores_s = halves.compute_s(1, 0)[0] - fused_halves.compute_s(1, 0)[0]
    assert scores_s == pytest.approx(elements * 32 / hbm / 2, rel=0.02)


def test_the_profiler_marks_eager_attention():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    for implementation, keeps_scores in (("eager", True), ("sdpa", False)):
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation=implementation)
        assert model_arch(model).attention_scores is keeps_scores


def _offloaded_step(spec, offload_all: bool):
    profile = gpt2_profile(hidden=512, layers=4, heads=8, vocab=1024, seq_len=256, flash_attention=True)
    model = CostModel(profile, spec, gpus_per_node=8)
    chunk = 2**22
    layout = model.layout(chunk)
    shape = Shape(chunk, layout.num_cacheable, layout.num_chunks if offload_all else 0, 1, 0, 8, 1)
    return model, shape, model.step_time(shape)


def test_a_plan_faster_than_the_best_published_mfu_is_reported_not_clamped():
    _, _, free = _offloaded_step(_spec(), offload_all=False)
    assert "bound_excess_s" not in free.breakdown
    # The same plan on hardware whose best published MFU is 1%: the prediction stays the model's own,
    # and the breakdown says by how much it beats the bound (a defect that ``show`` reports).
    model, shape, bounded = _offloaded_step(_spec(best_mfu={"bf16": 0.01}), offload_all=False)
    useful = model.full_profile.flops_per_sample * shape.micro_batch_size
    assert bounded.step_time_s == pytest.approx(free.step_time_s)
    assert bounded.breakdown["bound_compute_s"] == pytest.approx(useful / (0.01 * 312e12))
    assert bounded.breakdown["bound_excess_s"] == pytest.approx(bounded.breakdown["bound_compute_s"] - free.step_time_s)
    assert binding_bound(bounded.breakdown) == ("bound_compute_s", pytest.approx(useful / (0.01 * 312e12)))


def test_offloaded_shards_are_bounded_by_pcie_and_host_adam():
    slow_link = _spec(h2d_gbps_all=0.001, d2h_gbps_all=0.001)
    model, shape, step = _offloaded_step(slow_link, offload_all=True)
    shard_numel = shape.chunk_size // 8
    offloaded = shape.num_offloaded * shard_numel
    assert step.breakdown["bound_pcie_s"] == pytest.approx(offloaded * 2 / 1e6)
    assert step.step_time_s >= step.breakdown["bound_pcie_s"]
    assert binding_bound(step.breakdown)[0] == "bound_pcie_s"
    bounds = plausibility_bound(slow_link, "bf16", 0.0, offloaded, 8, 8)
    node_rate = slow_link.cpu_adam_node_elems_per_s or slow_link.cpu_adam_elems_per_s * 8
    assert bounds["bound_cpu_adam_s"] == pytest.approx(offloaded * 8 / node_rate)
    # A CPU device has no host link to cross: no PCIe or host-Adam bound.
    cpu = dataclasses.replace(slow_link, device="cpu")
    assert plausibility_bound(cpu, "bf16", 0.0, offloaded, 8, 8)["bound_pcie_s"] == 0


def test_presets_reject_a_best_mfu_outside_zero_to_one():
    assert any("best_mfu.bf16" in p for p in spec_problems(_spec(best_mfu={"bf16": 46.4})))
    assert any("attention_tflops.bf16" in p for p in spec_problems(_spec(attention_tflops={"bf16": -1.0})))
    assert not [p for p in spec_problems(_spec(best_mfu={"bf16": 0.464})) if "best_mfu" in p]


def test_padding_is_every_chunk_element_no_parameter_holds():
    profile = gpt2_profile(hidden=64, layers=4, heads=2, vocab=128, positions=64, seq_len=64)
    layout = pack_chunks(profile, 64 * 1024)
    held = sum(p.numel for p in profile.params if p.requires_grad)
    assert layout.padding_numel == layout.num_chunks * 64 * 1024 - held
    assert layout.padding_share == pytest.approx(layout.padding_numel / (layout.num_chunks * 64 * 1024))
    # The memory estimate counts whole chunks, padding included.
    spec = _spec()
    model = CostModel(profile, spec, gpus_per_node=8)
    shape = Shape(64 * 1024, layout.num_cacheable, 0, 1, 0, 1, 1)
    memory = model.memory(shape)
    assert memory.peak_gpu_bytes >= layout.num_chunks * 64 * 1024 // 8 * 16


def test_the_search_adds_chunk_sizes_with_less_padding_than_its_grid():
    profile = gpt2_profile(hidden=5120, layers=40, heads=40, vocab=50368, positions=2048, seq_len=2048)
    model = CostModel(profile, _spec(), gpus_per_node=8)
    largest = largest_trainable_numel(profile)
    trainable = sum(p.numel for p in profile.params if p.requires_grad and not p.shared)
    grid = chunk_size_grid(largest, trainable, 8)
    sizes = chunk_sizes(model, {})
    assert set(grid) < set(sizes)
    for size in even_split_sizes(largest, trainable, 8):
        assert size % (8 * 1024) == 0 and grid[0] <= size <= grid[-1]
    best_grid = min(model.layout(size).padding_share for size in grid)
    best_added = min(model.layout(size).padding_share for size in set(sizes) - set(grid))
    assert best_added < best_grid / 2  # 13B-like: 7.7% of the chunk elements -> 2.8%
