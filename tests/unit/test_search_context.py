"""Context parallelism in the cost model and the search (``--fix context=C``): a context rank's
activations and compute are 1/C of its group's samples, the chunks shard over data x context, the
all-to-alls are priced, and a pin the engine cannot run is refused with the reason."""

from __future__ import annotations

import pytest

from elixir_tune.cli.show import mesh_lines, parallel_line
from elixir_tune.costmodel.context import EXCHANGE_COPIES, ulysses_all_to_all_s
from elixir_tune.costmodel.model import CostModel
from elixir_tune.costmodel.parallel import DATA_ONLY, Layout
from elixir_tune.costmodel.shape import Shape
from elixir_tune.costmodel.synthetic import example_hardware, gpt2_profile
from elixir_tune.plan import validate
from elixir_tune.search import search

SEQ = 2048


@pytest.fixture(scope="module")
def profile():
    return gpt2_profile("p", hidden=256, layers=4, heads=4, vocab=1024, positions=SEQ, seq_len=SEQ)


# One chunk of 1M elements per cache slot, nothing offloaded, one micro-batch per step, no recomputation.
SHAPE = {"chunk_size": 1 << 20, "cache_blocks": 2, "num_offloaded": 0, "prefetch": 1, "grad_accum_steps": 1, "every": 0}


def _shape(micro: int) -> Shape:
    return Shape(micro_batch_size=micro, **SHAPE)


def test_a_context_rank_holds_the_activations_of_half_its_groups_samples(profile):
    hardware = example_hardware(gpus_per_node=2)
    context = CostModel(profile, hardware, 2, layout=Layout(context=2))
    data = CostModel(profile, hardware, 2, layout=DATA_ONLY)
    assert context.data_size == data.data_size == 2  # chunks shard over data x context
    # Two samples split over a context group of 2 cost each rank what one sample costs a data rank, plus
    # the exchange's buffers: 3 copies of q, k, v and the output (4 x h per token) of its 1024 tokens.
    exchange_bytes = 2 * EXCHANGE_COPIES * (SEQ // 2) * 256 * 4 * 2  # 2 samples, bf16
    one_sample = data.memory(_shape(1)).activation_bytes
    assert context.memory(_shape(2)).activation_bytes == pytest.approx(one_sample + exchange_bytes, rel=1e-3)
    assert context.memory(_shape(2)).activation_bytes < data.memory(_shape(2)).activation_bytes * 0.6
    breakdown = context.step_time(_shape(2)).breakdown
    assert breakdown["context_comm_s"] > 0
    assert "context_comm_s" not in data.step_time(_shape(1)).breakdown


def test_all_to_all_bytes_follow_ulysses():
    # C = 2, 1000 tokens per rank, h 100, no GQA, 2-byte elements, one block, at 1e9 B/s, no latency:
    # forward q, k, v and the output (4 x 1000 x 100 x 2 bytes, half of it sent), backward the same.
    seconds = ulysses_all_to_all_s(2, 1000, 100, 1.0, 2, 1, 0, link_bytes_per_s=1e9, latency_s=0.0)
    assert seconds == pytest.approx(2 * 4 * 1000 * 100 * 2 / 2 / 1e9)
    recomputed = ulysses_all_to_all_s(2, 1000, 100, 1.0, 2, 1, 1, link_bytes_per_s=1e9, latency_s=0.0)
    assert recomputed == pytest.approx(seconds * 1.5)
    assert ulysses_all_to_all_s(1, 1000, 100, 1.0, 2, 1, 1, link_bytes_per_s=1e9, latency_s=0.0) == 0.0


def test_a_pinned_context_degree_gives_a_plan_that_validates(profile):
    result = search(
        profile, example_hardware(gpus_per_node=2), gpus_per_node=2, global_batch_size=1, fixed=["context=2"]
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
        (3, 2, 2, [], "does not divide model.num_heads 3"),
        (4, 3, 3, [], "does not divide the world of 3 GPUs"),
        (4, 4, 3, [], "the global batch 3 does not split over the 2 data-parallel ranks"),
        (4, 2, 2, ["tensor=2"], "with tensor parallelism"),
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
