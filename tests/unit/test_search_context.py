"""Context parallelism in the cost model and the search: a context rank's activations and compute
are 1/C of its group's samples, the chunks shard over data x context, each mode's exchange is priced
on the group's link, the search ranks C with every other layout, and a pin the engine cannot run is
refused with the reason."""

from __future__ import annotations

import pytest

from elixir_tune.cli.show import mesh_lines, parallel_line
from elixir_tune.costmodel.context import (
    EXCHANGE_COPIES,
    RING_SCORE_BYTES,
    ContextWidths,
    ExchangeRates,
    context_exchange,
    context_share,
    held_bytes_per_sample,
)
from elixir_tune.costmodel.links import context_link_bytes_per_s
from elixir_tune.costmodel.model import CostModel
from elixir_tune.costmodel.parallel import DATA_ONLY, Layout
from elixir_tune.costmodel.shape import Shape
from elixir_tune.costmodel.synthetic import example_hardware, gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.plan import validate
from elixir_tune.plan.context import CONTEXT_PARALLEL_RUNS_WITH
from elixir_tune.search import search
from elixir_tune.search.layouts import layout_choices

SEQ = 2048


@pytest.fixture(scope="module")
def profile():
    return gpt2_profile("p", hidden=256, layers=4, heads=4, vocab=1024, positions=SEQ, seq_len=SEQ)


# One chunk of 1M elements per cache slot, nothing offloaded, one micro-batch per step, no recomputation.
SHAPE = {"chunk_size": 1 << 20, "cache_blocks": 2, "num_offloaded": 0, "prefetch": 1, "grad_accum_steps": 1, "every": 0}
# A link of 1 GB/s with no latency and copies that cost nothing: the bytes alone show.
BARE = ExchangeRates(link_bytes_per_s=1e9, latency_s=0.0, copy_bytes_per_s=float("inf"))


def _shape(micro: int) -> Shape:
    return Shape(micro_batch_size=micro, **SHAPE)


def _widths(degree: int, mode: str, seq: int = 1000 * 8, kv: float = 100.0) -> ContextWidths:
    return ContextWidths(degree, mode, seq, q_width=100.0, kv_width=kv, element_bytes=2)


def test_a_context_rank_holds_the_activations_of_half_its_groups_samples(profile):
    hardware = example_hardware(gpus_per_node=2)
    context = CostModel(profile, hardware, 2, layout=Layout(context=2))
    data = CostModel(profile, hardware, 2, layout=DATA_ONLY)
    assert context.data_size == data.data_size == 2  # chunks shard over data x context
    # Two samples split over a context group of 2 cost each rank what one sample costs a data rank, plus
    # the exchange's buffers: 4 copies of q, k, v and the output (4 x h per token) of its 1024 tokens.
    exchange_bytes = 2 * EXCHANGE_COPIES * (SEQ // 2) * 256 * 4 * 2  # 2 samples, bf16
    one_sample = data.memory(_shape(1)).activation_bytes
    assert context.memory(_shape(2)).activation_bytes == pytest.approx(one_sample + exchange_bytes, rel=1e-3)
    assert context.memory(_shape(2)).activation_bytes < data.memory(_shape(2)).activation_bytes * 0.6
    breakdown = context.step_time(_shape(2)).breakdown
    assert breakdown["context_comm_s"] > 0
    assert "context_comm_s" not in data.step_time(_shape(1)).breakdown


def test_ulysses_sends_c_minus_1_over_c_of_q_k_v_and_the_output_so_its_bytes_per_rank_fall_with_c():
    # 8000 tokens, 1 sample: each rank has 8000 / C tokens of q, k, v and the output (4 x 100 wide, 2 bytes).
    def forward_s(degree: int) -> float:
        return context_exchange(_widths(degree, "ulysses"), 1, 0.0, BARE).forward_s

    for degree in (2, 4, 8):
        assert forward_s(degree) == pytest.approx((degree - 1) / degree * 8000 / degree * 400 * 2 / 1e9)
    assert forward_s(8) < forward_s(4) < forward_s(2)  # per rank: (C - 1) / C^2 of a sample's tensors
    exchange = context_exchange(_widths(2, "ulysses"), 1, 0.0, BARE)
    assert exchange.backward_s == exchange.forward_s and exchange.attention_extra_s == 0.0
    # A recomputed block runs its forward exchange again: 2 blocks, 1 recomputed.
    assert exchange.step_s(2, 1) == pytest.approx(5 * exchange.forward_s)
    assert context_exchange(_widths(1, "ulysses"), 1, 1.0, BARE).step_s(4, 4) == 0.0


def test_the_ring_hides_its_sends_under_each_steps_attention_and_the_allgather_form_computes_the_masked_half():
    widths = _widths(4, "ring")
    kv_bytes = 2000 * 2 * 100 * 2  # one rank's k and v block: 2000 tokens
    # Compute covers the sends (1 s of attention, 0.25 s a step): only the last gradient send is exposed.
    covered = context_exchange(widths, 1, 1.0, BARE)
    assert covered.forward_s == 0.0
    assert covered.backward_s == pytest.approx(2 * kv_bytes / 1e9)  # the fp32 gradient block, home
    # No compute to hide behind: forward C - 1 sends, backward C - 1 of the block and its gradient, and one more.
    bare = context_exchange(widths, 1, 0.0, BARE)
    assert bare.forward_s == pytest.approx(3 * kv_bytes / 1e9)
    assert bare.backward_s == pytest.approx(3 * 3 * kv_bytes / 1e9 + 2 * kv_bytes / 1e9)
    # On a CPU device the sends run on the compute cores: nothing hides them.
    serial = ExchangeRates(1e9, 0.0, float("inf"), overlaps=False)
    assert context_exchange(widths, 1, 1.0, serial).forward_s == pytest.approx(bare.forward_s)
    # The all-gather form gathers the other ranks' k and v and computes every score of its rows: its
    # attention again, forward and backward, beside a ring whose sends the compute covers.
    gathered = context_exchange(_widths(4, "allgather"), 1, 1.0, BARE)
    assert gathered.attention_extra_s == pytest.approx(3.0)
    assert gathered.forward_s == pytest.approx(3 * kv_bytes / 1e9)
    assert covered.step_s(4, 0) < gathered.step_s(4, 0)


def test_each_mode_keeps_what_its_backward_needs():
    # The all-gather form keeps the other ranks' k and v and the mask of its rows (n x S) per block.
    assert held_bytes_per_sample(_widths(4, "allgather")) == (6000 * 2 * 100 + 2000 * 8000) * 2
    assert held_bytes_per_sample(_widths(4, "ring")) == held_bytes_per_sample(_widths(4, "ulysses")) == 0
    long = gpt2_profile("p", hidden=256, layers=4, heads=4, vocab=1024, positions=SEQ, seq_len=SEQ)
    plain = {
        mode: context_share(long, 2, mode).activation.per_sample_bytes for mode in ("ulysses", "allgather", "ring")
    }
    assert plain["allgather"] > plain["ulysses"]
    # The engine's ring computes attention in eager form: one key block's fp32 scores against all the
    # rank's queries are alive in its backward (RING_SCORE_BYTES per element), which no kernel path holds.
    n = SEQ // 2
    assert plain["ring"] - plain["ulysses"] >= RING_SCORE_BYTES * 4 * n * n
    checkpointed = context_share(long, 2, "allgather").activation_checkpointed
    assert checkpointed is not None and checkpointed.per_sample_bytes < plain["allgather"]


def test_a_context_group_on_one_node_moves_at_the_node_links_and_off_it_at_one_card():
    hardware = load_hardware("h100-80gb-sxm")
    node = hardware.allgather_gbps * 1e9
    assert context_link_bytes_per_s(hardware, 8, 8, 1, "ulysses") == node
    card = hardware.inter_node_gbps * 1e9 / 8
    assert context_link_bytes_per_s(hardware, 8, 16, 1, "ring") == pytest.approx(card)
    # All-to-all over 2 nodes: 8 of 15 peers off the node through its card, 7 on the node meanwhile.
    assert context_link_bytes_per_s(hardware, 8, 16, 1, "ulysses") == pytest.approx(15 / (8 / card))
    # With tensor degree 4 a node holds 2 ranks of the group: C = 4 spans two nodes.
    assert context_link_bytes_per_s(hardware, 8, 4, 4, "allgather") < node


def test_a_pinned_context_degree_gives_a_plan_that_validates(profile):
    result = search(
        profile,
        example_hardware(gpus_per_node=2),
        gpus_per_node=2,
        global_batch_size=1,
        fixed=["context=2", "context_mode=ulysses"],
    )
    plan = result.plan
    assert plan.parallel.context.degree == 2 and plan.parallel.context.mode == "ulysses"
    assert (plan.data_parallel_size, plan.shard_group_size) == (1, 2)
    assert plan.training.micro_batch_size == 1  # one sample per step, half of it on each rank
    assert validate(plan) == []
    assert all(c.layout == Layout(context=2) for c in result.candidates)
    # `show` says what the layout is and what its all-to-alls cost.
    line = parallel_line(plan)
    assert "x context 2" in line and "all-to-all over heads" in line and "of the predicted step" in line
    assert mesh_lines(plan) == [
        "context groups hold shares of the same sequences and exchange keys and values (consecutive ranks): [0,1]"
    ]


@pytest.mark.parametrize(
    ("heads", "gpus", "batch", "extra", "expected"),
    [
        (3, 2, 2, ["context_mode=ulysses"], "does not divide model.num_heads 3"),
        (4, 3, 3, [], "does not divide the world of 3 GPUs"),
        (4, 4, 3, [], "the global batch 3 does not split over the 2 data-parallel ranks"),
        (4, 2, 2, ["tensor=2"], "with tensor parallelism"),
        pytest.param(
            4,
            2,
            2,
            ["context_mode=ring"],
            "mode ring",
            marks=pytest.mark.skipif(CONTEXT_PARALLEL_RUNS_WITH["ring"], reason="the engine runs ring attention"),
        ),
    ],
)
def test_pins_the_engine_cannot_run_are_refused(heads, gpus, batch, extra, expected):
    profile = gpt2_profile("p", hidden=96, layers=2, heads=heads, vocab=1024, positions=256, seq_len=256)
    with pytest.raises(ValueError, match="--fix context=2") as error:
        search(
            profile,
            example_hardware(gpus_per_node=gpus),
            gpus_per_node=gpus,
            global_batch_size=batch,
            fixed=["context=2", *extra],
            loop="forward_backward",
        )
    assert expected in str(error.value)


def test_every_searched_context_layout_is_one_validate_accepts():
    # The modes plan/context.py accepts (ring once the engine runs it), and no mode another dominates.
    profile = gpt2_profile("p", hidden=96, layers=2, heads=4, vocab=1024, positions=256, seq_len=256)
    hardware = example_hardware(gpus_per_node=4)
    layouts = layout_choices(profile, 4, 1, 4, {})
    runs = {"ulysses", "allgather"} | ({"ring"} if CONTEXT_PARALLEL_RUNS_WITH["ring"] else set())
    assert {(lay.context, lay.context_mode) for lay in layouts if lay.context > 1} == {
        (c, m) for c in (2, 4) for m in runs
    }
    result = search(profile, hardware, gpus_per_node=4, global_batch_size=4, top_k=50)
    assert set(result.models) <= set(layouts)
    for candidate in result.candidates:
        assert validate(search(profile, hardware, 4, global_batch_size=4, fixed=_pins(candidate.layout)).plan) == []


def _pins(layout: Layout) -> list[str]:
    return [f"context={layout.context}", f"context_mode={layout.context_mode}"] if layout.context > 1 else ["context=1"]


LONG_H100 = dict(hidden=1024, layers=8, heads=16, vocab=32768, positions=32768, seq_len=32768, flash_attention=True)


def test_the_search_picks_c_where_it_is_the_fastest_plan_that_fits_and_not_otherwise():
    hardware = load_hardware("h100-80gb-sxm")
    long = gpt2_profile("long", **LONG_H100)
    # 20 GiB a rank: data parallelism fits only by recomputing every 4th block; C = 2 needs no recomputation.
    budget = {"device_memory_bytes": 20 * 2**30, "global_batch_size": 2}
    chosen = search(long, hardware, gpus_per_node=2, **budget)
    without = search(long, hardware, gpus_per_node=2, fixed=["context=1"], **budget)
    assert chosen.plan.parallel.context.degree == 2 and validate(chosen.plan) == []
    assert without.plan.training.activation_checkpointing.every > 0
    assert chosen.candidates[0].step_time_s < without.candidates[0].step_time_s
    assert "context 2" in chosen.why and "its exchange is" in chosen.why
    # The whole device: data parallelism fits without recomputing and skips the exchange.
    roomy = search(long, hardware, gpus_per_node=2, global_batch_size=2)
    assert roomy.plan.parallel.context.degree == 1
    assert any(layout.context > 1 for layout in roomy.models)  # tried and ranked, not chosen
    short = gpt2_profile("short", **{**LONG_H100, "seq_len": 1024})
    assert search(short, hardware, gpus_per_node=2, global_batch_size=2).plan.parallel.context.degree == 1


def test_where_nothing_else_fits_the_search_picks_a_context_degree():
    # 32768 tokens a sample (eager attention: its scores are kept), one sample per rank: no data,
    # tensor or pipeline shape fits 16 GiB (recomputation and offload included: 23.1 GiB at least);
    # half a sample per rank does.
    long = gpt2_profile("long", hidden=256, layers=4, heads=4, vocab=1024, positions=32768, seq_len=32768)
    hardware = example_hardware(gpus_per_node=2)
    budget = {"device_memory_bytes": 16 * 2**30, "global_batch_size": 2, "loop": "forward_backward"}
    with pytest.raises(ValueError, match="nothing fits"):
        search(long, hardware, gpus_per_node=2, fixed=["context=1"], **budget)
    result = search(long, hardware, gpus_per_node=2, **budget)
    plan = result.plan
    assert plan.parallel.context.degree == 2 and validate(plan) == []
    assert plan.prediction is not None and plan.prediction.peak_gpu_bytes <= budget["device_memory_bytes"]
    assert "no layout without context parallelism fits" in result.why


def test_the_search_scales_to_131072_tokens_a_sample():
    # A 1.3B-shaped model at 128k tokens on 8 H100s: its activations need C, and every figure stays finite.
    model = gpt2_profile(
        "long",
        hidden=2048,
        layers=16,
        heads=16,
        vocab=32768,
        positions=131072,
        seq_len=131072,
        flash_attention=True,
        dropout=False,
    )
    result = search(
        model, load_hardware("h100-80gb-sxm"), gpus_per_node=8, global_batch_size=8, loop="forward_backward"
    )
    plan = result.plan
    assert validate(plan) == [] and plan.training.seq_len == 131072
    assert plan.parallel.context.degree > 1
    prediction = plan.prediction
    assert prediction is not None and 0 < prediction.step_time_s < 1e4
    assert 0 < prediction.peak_gpu_bytes <= result.usable_gpu_bytes
    assert prediction.tokens_per_s == pytest.approx(8 * 131072 / prediction.step_time_s, rel=1e-3)
