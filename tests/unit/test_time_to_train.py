"""Time-to-train planning: the scaling law's batch limit, the network presets and the frontier's sanity."""

from __future__ import annotations

import functools
import math

import pytest

from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.hardware.networks import network_gbps, with_network
from elixir_tune.search import search
from elixir_tune.search.scaling import (
    KAPLAN_ALPHA_B,
    KAPLAN_ALPHA_D,
    KAPLAN_B_STAR_TOKENS,
    KAPLAN_D_C,
    KAPLAN_N_C,
    batch_limit,
    compute_optimal_tokens,
    critical_batch_tokens,
    kaplan_loss_nats,
    non_embedding_params,
)
from elixir_tune.search.time_to_train import cluster_sizes, largest_batch, time_bound_s, time_to_train

LOOP = {"loop": "forward_backward"}


@functools.cache
def small_model():
    """A GPT-2 of 8 blocks of width 256: searches in well under a second per cluster."""
    return gpt2_profile("small", hidden=256, layers=8, heads=8, seq_len=512, positions=512)


@functools.cache
def h100():
    return load_hardware("h100-80gb-sxm")


def test_the_law_at_its_own_constants():
    # At N = N_c with unlimited data the loss is exactly 1 nat, where the critical batch is B*;
    # at N = N_c and D = D_c the two terms are equal: L = 2 ** alpha_D.
    assert kaplan_loss_nats(KAPLAN_N_C, 1e40) == pytest.approx(1.0)
    assert critical_batch_tokens(1.0) == pytest.approx(KAPLAN_B_STAR_TOKENS)
    assert kaplan_loss_nats(KAPLAN_N_C, KAPLAN_D_C) == pytest.approx(2**KAPLAN_ALPHA_D)
    assert critical_batch_tokens(2.0) == pytest.approx(KAPLAN_B_STAR_TOKENS / 2 ** (1 / KAPLAN_ALPHA_B))


def test_a_bigger_model_or_more_tokens_lower_the_loss_and_raise_the_limit():
    losses = [kaplan_loss_nats(n, d) for n, d in ((1e8, 2e9), (1e9, 2e9), (1e9, 2e10), (1e11, 2e12))]
    assert losses == sorted(losses, reverse=True)
    limits = [critical_batch_tokens(loss) for loss in losses]
    assert limits == sorted(limits)
    with pytest.raises(ValueError, match="positive"):
        kaplan_loss_nats(0, 1e9)


def test_n_counts_the_blocks_only_and_the_user_limit_wins():
    profile = small_model()
    # Each GPT-2 block: 12 h^2 in its four matrices, 13 h in biases and norms.
    assert non_embedding_params(profile) == 8 * (12 * 256**2 + 13 * 256)
    assert non_embedding_params(profile) < profile.num_params  # the embeddings are left out
    law = batch_limit(profile, 1e9)
    assert law.source == "kaplan" and law.loss_nats == pytest.approx(kaplan_loss_nats(law.non_embedding_params, 1e9))
    assert "estimate" in law.describe()
    user = batch_limit(profile, 1e9, override_tokens=65536)
    assert (user.tokens, user.source, user.samples(512)) == (65536, "user", 128)
    with pytest.raises(ValueError, match="--batch-limit"):
        batch_limit(profile, 1e9, override_tokens=0)
    assert compute_optimal_tokens(175e9) == pytest.approx(3.5e12)


def test_network_presets_replace_the_inter_node_bandwidth_only():
    hardware = h100()
    slow = with_network(hardware, "eth-25")
    assert slow.inter_node_gbps == pytest.approx(25 / 8 * 0.9)
    assert network_gbps("ib-ndr") == pytest.approx(hardware.inter_node_gbps)  # the preset's own figure
    assert slow.allgather_gbps == hardware.allgather_gbps and "eth-25" in slow.sources["inter_node_gbps"]
    assert with_network(hardware, None) is hardware
    with pytest.raises(ValueError, match="eth-100"):
        with_network(hardware, "token-ring")


def test_cluster_sizes_nest_and_batches_stay_under_the_limit():
    assert cluster_sizes(8, 100) == [(1, 8), (2, 8), (4, 8), (8, 8)]
    assert cluster_sizes(8, 5) == [(1, 1), (1, 2), (1, 4)]
    for smaller, larger in ((8, 16), (40, 64), (1000, 4096)):
        assert set(cluster_sizes(8, smaller)) <= set(cluster_sizes(8, larger))
    for world in (1, 8, 64, 4096):
        for limit in (1, 7, 100, 1000, 11157):
            batch = largest_batch(world, limit)
            assert batch <= limit
            if batch:  # divisible by the whole world or a power-of-two share of it
                assert any(batch % (world >> k) == 0 for k in range(world.bit_length()) if world >> k)
    assert largest_batch(4096, 11157) == 8192 and largest_batch(4096, 1000) == 512 * (1000 // 512)


def test_the_answer_never_exceeds_the_batch_limit():
    profile = small_model()
    # A limit that binds: 48 samples of 512 tokens, below 64 GPUs' one sample each.
    answer = time_to_train(profile, h100(), 10**9, max_gpus=64, batch_limit_tokens=48 * 512, full_frontier=True, **LOOP)
    assert answer.limit.samples(512) == 48
    searched = [a for a in answer.frontier if a.ok]
    assert searched and answer.best in searched
    for item in searched:
        plan = item.result.plan
        assert plan.training.global_batch_size * plan.training.seq_len <= answer.limit.tokens
        assert item.steps == math.ceil(10**9 / (item.global_batch_size * 512))


def test_more_gpus_never_make_the_best_answer_slower():
    profile = small_model()
    previous = math.inf
    for max_gpus in (1, 2, 8, 16, 32, 64):
        best = time_to_train(profile, h100(), 10**9, max_gpus=max_gpus, **LOOP).best
        assert best is not None
        assert best.time_s <= previous * (1 + 1e-12)
        previous = best.time_s


def test_skipped_sizes_are_bounded_above_the_answer_and_the_full_frontier_agrees():
    profile = small_model()
    pruned = time_to_train(profile, h100(), 10**9, max_gpus=64, **LOOP)
    full = time_to_train(profile, h100(), 10**9, max_gpus=64, full_frontier=True, **LOOP)
    assert pruned.best is not None and full.best is not None
    assert pruned.best.time_s == pytest.approx(full.best.time_s)
    searched = {a.gpus: a for a in full.frontier if a.ok}
    for item in pruned.frontier:
        if item.problem.startswith("not searched"):
            assert item.bound_s > pruned.best.time_s
            assert searched[item.gpus].time_s >= item.bound_s * (1 - 1e-9)  # the bound holds


def test_with_the_cluster_fixed_it_equals_todays_search():
    profile, hardware = small_model(), with_network(h100(), "eth-25")
    answer = time_to_train(profile, hardware, 3 * 10**8, nodes=2, gpus_per_node=8, **LOOP)
    assert [(a.nodes, a.gpus_per_node) for a in answer.frontier] == [(2, 8)]
    best = answer.best
    assert best is not None and best.result is not None
    today = search(profile, hardware, gpus_per_node=8, nodes=2, global_batch_size=best.global_batch_size, **LOOP)
    assert best.step_time_s == today.candidates[0].step_time_s
    assert best.tokens_per_s == today.candidates[0].tokens_per_s
    assert best.time_s == pytest.approx(math.ceil(3 * 10**8 / (best.global_batch_size * 512)) * best.step_time_s)
    assert best.time_s >= time_bound_s(profile, hardware, 16, best.global_batch_size, best.steps)


def test_a_slower_network_is_never_faster_and_fewest_gpu_hours_is_cheapest():
    profile = small_model()
    fast = time_to_train(profile, h100(), 10**9, max_gpus=32, full_frontier=True, **LOOP)
    slow = time_to_train(profile, with_network(h100(), "eth-25"), 10**9, max_gpus=32, full_frontier=True, **LOOP)
    for a, b in zip(fast.frontier, slow.frontier, strict=True):
        if a.ok and b.ok and a.nodes > 1:
            assert b.time_s >= a.time_s * (1 - 1e-9)
    cheap = time_to_train(profile, h100(), 10**9, max_gpus=32, objective="gpu-hours", **LOOP)
    assert cheap.best is not None
    assert cheap.best.gpu_hours == min(a.gpu_hours for a in cheap.frontier if a.ok)


def test_bad_requests_say_what_to_change():
    profile = small_model()
    with pytest.raises(ValueError, match="--batch-limit"):
        time_to_train(profile, h100(), 10**9, max_gpus=8, global_batch_size=10**6)
    with pytest.raises(ValueError, match="--max-gpus"):
        time_to_train(profile, h100(), 10**9)
    with pytest.raises(ValueError, match="--objective"):
        time_to_train(profile, h100(), 10**9, max_gpus=8, objective="cost")
