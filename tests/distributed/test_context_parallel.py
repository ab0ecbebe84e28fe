"""Context parallelism (``parallel.context``) against plain PyTorch on the whole sequence: gloo, CPU,
real transformers GPT-2 and Llama (grouped-query attention: 4 heads, 2 key/value heads).

Ulysses (all-to-all over heads; each rank holds a contiguous half of every sample's 16 tokens) and the
all-gather form (chunks i and 2C - 1 - i of 2C per rank; every rank's keys and values gathered) at
context 2, world 2; at world 4 data 2 x context 2 and, all-gather only, context 4 over 2 key/value heads.
sdpa and eager attention, the plain loop and ``forward_backward``, right-padded rows (attention_mask
0, labels -100: every rank and micro-batch counts different tokens), recomputed blocks, offloaded
chunks, LoRA; and the zoo's Qwen2, Qwen3, Phi-3, Granite, OLMo2, Gemma2 (sliding window, soft-capping) and
two mixtures of experts at world 2, and Mistral (a sliding window on every layer) in all three modes. Ring attention (the same split, key/value blocks passed around the
group) on Llama, Qwen3, Gemma2, Phi-3 and Qwen3-MoE at world 2 and Gemma2 at context 4. Heavy: context 2
x tensor 2 (1D) at world 4, ring, all-gather and Ulysses; context 2 x pipeline 2 at world 4, all three modes
and GPT-2's tied embedding (Ulysses on the Llama also in CI); context 2 x pipeline 2 x tensor 2 at world 8. fp32: step losses 1e-5 relative, final weights 1e-5 absolute
after 4 AdamW steps (eps 1e-6, as the other engine tests). A script that feeds the ranks of a
context group different rows is stopped at the first forward.

Memory: plans searched with ``--fix context=2`` for Llama and GPT-2 tiny (seq 64), with and without
recomputation; rank 0's measured peak (``memory_probe``) lies within 0.8-1.10x of the plan's promise (see OVER_PROMISE),
and the step's own allocations are below those of the data-parallel plan of the same global batch.
"""

from __future__ import annotations

import pytest

from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FP32_LOSS_REL = 1e-5
FP32_WEIGHT_ABS = 1e-5
WORLD2 = [
    dict(model="gpt2", attn="eager", context=2, loop="plain"),
    dict(model="llama", attn="sdpa", context=2, loop="forward_backward", accum=2, checkpoint=1, padded=True),
    dict(model="gpt2", attn="sdpa", context=2, loop="plain", padded=True, offload=0.5, cache="min"),
    dict(model="llama", attn="eager", context=2, loop="plain", padded=True),
    dict(model="gpt2", attn="eager", context=2, loop="forward_backward", accum=2, padded=True, checkpoint=1),
    # The all-gather form: chunks i and 3 - i of 4 per rank, every rank's keys and values gathered.
    dict(model="llama", attn="sdpa", context=2, loop="plain", padded=True, mode="allgather"),
    dict(model="gpt2", attn="eager", context=2, loop="forward_backward", accum=2, checkpoint=1, mode="allgather"),
    dict(model="zoo:gemma2", attn="eager", context=2, loop="plain", padded=True, mode="allgather"),
    # LoRA (PEFT's wrapper; the base in frozen chunks), both forms.
    dict(model="llama", attn="sdpa", context=2, loop="plain", padded=True, lora=True),
    dict(
        model="llama", attn="eager", context=2, loop="forward_backward", accum=2, padded=True, lora=True,
        mode="allgather", offload=0.5, cache="min",
    ),
]  # fmt: skip
# The zoo's other families at world 2 (hidden 32, 4 heads, 2 key/value heads): Gemma2 with its sliding
# window of 4 (shorter than the 16 tokens) and soft-capping (eager: transformers' sdpa refuses soft-capping),
# two mixtures of experts (fused experts, no expert parallelism), offload on one.
FAMILIES = [
    dict(model="zoo:qwen2", context=2, loop="plain", padded=True),
    dict(model="zoo:qwen3", context=2, loop="forward_backward", accum=2, padded=True),
    dict(model="zoo:phi3", context=2, loop="plain", padded=True),
    dict(model="zoo:granite", context=2, loop="plain"),
    dict(model="zoo:olmo2", context=2, loop="plain", padded=True),
    dict(model="zoo:gemma2", attn="eager", context=2, loop="plain", padded=True),
    dict(model="zoo:qwen3_moe", context=2, loop="plain", padded=True, chunk_size=8192),
    dict(
        model="zoo:mixtral", context=2, loop="forward_backward", accum=2, padded=True, chunk_size=16384,
        offload=0.5, cache="min",
    ),
]  # fmt: skip
# Ring attention (K/V blocks passed around the group, merged by log-sum-exp; chunks i and 3 - i of 4 per
# rank), five families at world 2: Gemma2's window of 4 tokens is one chunk (whole blocks skipped), with
# soft-capping; the Llama with recomputed blocks and offloaded chunks.
RING = [
    dict(
        model="llama", attn="sdpa", context=2, loop="forward_backward", accum=2, padded=True, checkpoint=1,
        offload=0.5, cache="min", mode="ring",
    ),
    dict(model="zoo:qwen3", context=2, loop="plain", padded=True, mode="ring"),
    dict(model="zoo:gemma2", attn="eager", context=2, loop="plain", padded=True, mode="ring"),
    dict(model="zoo:phi3", context=2, loop="forward_backward", accum=2, padded=True, mode="ring"),
    dict(model="zoo:qwen3_moe", context=2, loop="plain", padded=True, chunk_size=8192, mode="ring"),
]  # fmt: skip
# Mistral (its sliding window of 4 tokens on every layer), each mode once; last in the families' launch, so
# the cases before keep their batches (a case's data seed is its index in the launch).
MISTRAL = [
    dict(model="mistral", context=2, loop="plain", padded=True),
    dict(model="mistral", attn="eager", context=2, loop="plain", padded=True, mode="allgather"),
    # Measured: the ring 1.18e-5 (weights), plain PyTorch eager against sdpa 1.21e-5 on the same batches.
    dict(model="mistral", context=2, loop="forward_backward", accum=2, padded=True, mode="ring", control="attention"),
]  # fmt: skip
# Context 2 x tensor 2 (1D, sequence-parallel) at world 4: each tensor rank's heads over its context shard.
# The ring case carries a control (plain PyTorch with the row-parallel products summed in two halves, as
# tensor 2 sums them): the bound is twice its weight difference, 1e-5 at least, as in
# test_engine_tensor_parallel. Measured: ring 8.3e-6 (layer 1's v_proj), the control 5.3e-6 on the same
# batches (the all-gather form 3.3e-6 there; the ring without tensor parallelism 6e-7).
CONTEXT_TENSOR = [
    dict(model="llama", attn="sdpa", context=2, tensor=2, loop="plain", padded=True, mode="ring", control=True),
    dict(
        model="llama", attn="eager", context=2, tensor=2, loop="forward_backward", accum=2, padded=True,
        mode="allgather", offload=0.5, cache="min",
    ),
    # GPT-2's 4 heads: 2 per tensor rank, 1 per context rank under Ulysses.
    dict(model="zoo:gpt2", attn="eager", context=2, tensor=2, loop="plain", padded=True),
]  # fmt: skip
# Pipeline 2 x context 2 x tensor 2 (1D) at world 8: each stage's context groups T apart, the sequence
# shards of a tensor rank (S / C / T) sent to the next stage. The control as in CONTEXT_TENSOR.
CONTEXT_PIPELINE_TENSOR = [
    dict(
        model="llama", attn="sdpa", context=2, stages=2, tensor=2, loop="forward_backward", accum=2, padded=True,
        mode="allgather", control=True,
    ),
    dict(
        model="llama", attn="sdpa", context=2, stages=2, tensor=2, loop="forward_backward", accum=2, padded=True,
        mode="ring", control=True,
    ),
    # GPT-2's 4 heads: 2 per tensor rank, 1 per context rank; its tied embedding on both stages.
    dict(model="zoo:gpt2", attn="eager", context=2, stages=2, tensor=2, loop="forward_backward", accum=2, padded=True),
]  # fmt: skip
CONTROL_FACTOR = 2.0
PACKED = dict(model="llama", attn="sdpa", context=2, packed=True)
# Last, as it leaves its model mid-forward: ranks fed by RANK instead of data_rank().
SLICED_BY_RANK = dict(model="llama", attn="sdpa", context=2, slice_by_rank=True)
# Context 2 x pipeline 2 at world 4 (one block per stage): the first stage slices the tokens, the second
# gets 1/C of the sequence's hidden states and computes the loss of its tokens. GPT-2's tied embedding is
# held by both stages (its gradient summed over the stage pair at each context index).
CONTEXT_PIPELINE = [
    dict(model="llama", attn="sdpa", context=2, stages=2, loop="forward_backward", accum=2, padded=True),
    dict(
        model="llama", attn="eager", context=2, stages=2, loop="forward_backward", accum=2, padded=True,
        mode="allgather", offload=0.5, cache="min",
    ),
    dict(model="llama", attn="sdpa", context=2, stages=2, loop="forward_backward", accum=2, padded=True, mode="ring"),
    dict(model="gpt2", attn="eager", context=2, stages=2, loop="forward_backward", accum=2, padded=True),
]  # fmt: skip
WORLD4 = [
    dict(
        model="llama", attn="sdpa", context=2, loop="forward_backward", accum=2, padded=True, offload=0.5, cache="min"
    ),
    dict(model="gpt2", attn="eager", context=2, loop="plain"),
    # Context 4 over Llama's 2 key/value heads (Ulysses needs C to divide them; the all-gather form does not).
    dict(model="llama", attn="sdpa", context=4, loop="plain", padded=True, mode="allgather"),
    dict(
        model="zoo:qwen3", context=2, loop="forward_backward", accum=2, padded=True, mode="allgather", offload=0.5,
        cache="min",
    ),
    # A ring of 4 (each block passes three times; the sender and the receiver differ), Gemma2's window of
    # 4 tokens over chunks of 2.
    dict(model="zoo:gemma2", attn="eager", context=4, loop="plain", padded=True, mode="ring"),
    # Context 2 x pipeline 2 in CI (the heavy test has the other modes and GPT-2's tied embedding).
    CONTEXT_PIPELINE[0],
]  # fmt: skip


def check(per_rank: list[list[dict]], index: int) -> None:
    results = [rank_results[index] for rank_results in per_rank]
    context = results[0]["case"]["context"]
    model_parallel = context * results[0]["case"].get("tensor", 1) * results[0]["case"].get("stages", 1)
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
        # rank = ((data_index x P + stage) x C + context_index) x T + tensor_index: a context group shares its data index.
        assert (result["data"], result["data_rank"]) == (len(results) // model_parallel, rank // model_parallel), rank
        if result["case"]["loop"] == "plain":
            assert result["logits_len"] == 16 // context, rank  # each rank's logits cover its share of the sequence
    first = results[0]
    assert first["loss_rel"] <= FP32_LOSS_REL, (first["case"], first["loss_rel"])
    bound = max(FP32_WEIGHT_ABS, CONTROL_FACTOR * first.get("control_weight_abs", 0.0))
    assert first["weight_abs"] <= bound, (first["case"], first["weight_abs"], first.get("control_weight_abs"))


@pytest.fixture(scope="module")
def world2():
    return launch("context_parallel_worker.py", [*WORLD2, PACKED, SLICED_BY_RANK], 2, timeout_s=400)


@pytest.mark.parametrize("index", range(len(WORLD2)), ids=[str(c) for c in WORLD2])
def test_context2_world2_matches_torch(world2, index):
    check(world2, index)


@pytest.fixture(scope="module")
def families():
    # The ring cases ride the same launch (one start of the ranks fewer).
    return launch("context_parallel_worker.py", [*FAMILIES, *RING, *MISTRAL], 2, timeout_s=400)


@pytest.mark.parametrize("index", range(len(FAMILIES)), ids=[c["model"] for c in FAMILIES])
def test_context2_families_match_torch(families, index):
    check(families, index)


@pytest.mark.parametrize("index", range(len(RING)), ids=[c["model"] for c in RING])
def test_ring_attention_matches_torch(families, index):
    check(families, len(FAMILIES) + index)


@pytest.mark.parametrize("index", range(len(MISTRAL)), ids=[c.get("mode", "ulysses") for c in MISTRAL])
def test_mistral_sliding_window_matches_torch(families, index):
    check(families, len(FAMILIES) + len(RING) + index)


def test_world4_matches_torch():
    per_rank = launch("context_parallel_worker.py", WORLD4, 4, timeout_s=400)
    for index in range(len(WORLD4)):
        check(per_rank, index)


@pytest.mark.heavy  # 4 processes, the plain-PyTorch control beside each reference
def test_context2_x_tensor2_matches_torch():
    per_rank = launch("context_parallel_worker.py", CONTEXT_TENSOR, 4, timeout_s=600)
    for index in range(len(CONTEXT_TENSOR)):
        check(per_rank, index)


@pytest.mark.heavy  # 4 processes
def test_context2_x_pipeline2_matches_torch():
    per_rank = launch("context_parallel_worker.py", CONTEXT_PIPELINE, 4, timeout_s=600)
    for index in range(len(CONTEXT_PIPELINE)):
        check(per_rank, index)


@pytest.mark.heavy  # 8 processes
def test_context2_x_pipeline2_x_tensor2_matches_torch():
    per_rank = launch("context_parallel_worker.py", CONTEXT_PIPELINE_TENSOR, 8, timeout_s=600)
    for index in range(len(CONTEXT_PIPELINE_TENSOR)):
        check(per_rank, index)


def test_packed_rows_are_refused(world2):
    for rank, rank_results in enumerate(world2):
        error = rank_results[len(WORLD2)].get("packed_error")
        assert error and "does not run packed sequences yet" in error, (rank, rank_results[len(WORLD2)])


def test_ranks_of_a_context_group_fed_different_rows_are_stopped(world2):
    for rank, rank_results in enumerate(world2):
        error = rank_results[len(WORLD2) + 1].get("contract_error")
        assert error and "context ranks [1] got other inputs" in error and "data_rank()" in error, (rank, error)


# KNOWN GAP: a context-parallel step's measured peak varies between identical runs on CPU, where a
# data-parallel one does not (GPT-2 tiny recomputed: 3.54-3.84 MB against a promise of 3.84 MB; the
# Llama at 4096 tokens: 15.6-22.9 MB against 22.2 MB, 0.70-1.03x). Suspected: the blocking all-to-alls
# inside backward change what is in flight at the peak; not yet found. Until then the promise is an
# estimate, not a bound, for context-parallel plans: up to 10% over it passes.
OVER_PROMISE = 1.10


def _memory_case(model: str, checkpointing: str, context: int) -> dict:
    fixed = dict(offload=0.0, cache_blocks="all", prefetch=0, checkpointing=checkpointing)
    if context > 1:
        fixed["context"] = context
    return dict(fixed=fixed, micro_batch_size=2, accum=1, dtype="fp32", model=model)


# The plan's memory promise at C = 2 (searched with --fix context=2, measured by memory_probe on rank 0),
# beside the data-parallel plan of the same global batch (4 samples of 64 tokens on 2 ranks).
MEMORY_CASES = [
    _memory_case(model, checkpointing, context)
    for model in ("llama-tiny", "gpt2-tiny")
    for checkpointing in ("none", "all")
    for context in (2, 1)
]


def test_context2_peak_is_within_the_plans_promise_and_below_data_parallel():
    per_rank = launch("memory_fidelity_worker.py", MEMORY_CASES, 2, timeout_s=400)
    results = per_rank[0]
    for result in results:
        assert result["ok"], f"{result.get('error')}\n{result.get('trace')}"
    for context_result, data_result in zip(results[::2], results[1::2], strict=True):
        measured = context_result["measured"]["peak_bytes"]
        predicted = context_result["predicted_gpu_bytes"] + context_result["predicted_host_bytes_per_rank"]
        assert 0.8 * predicted <= measured <= OVER_PROMISE * predicted, (context_result["case"], measured, predicted)
        # Each rank computes half of every sample: the step's own allocations are well below data parallelism's
        # (measured 0.51-0.60x without recomputation; with it, gathers and staging weigh more of the step).
        bound = 0.7 if context_result["case"]["fixed"]["checkpointing"] == "none" else 0.95
        step_bytes = context_result["measured"]["step_peak_bytes"]
        assert step_bytes < bound * data_result["measured"]["step_peak_bytes"], context_result["case"]


# Llama (hidden 64) at 4096 tokens, one sample per rank at world 2; 626 MiB is what the cpu preset's
# margin leaves the search room for: no plan without context parallelism fits (629 MiB at least).
LONG = dict(seq=4096, budget_mib=626)


# Heavy: its measured peak moves with thread timing (16.1-22.1 MB over three idle launches of this very case,
# 0.72-0.995x of the 22.2 MB promise), and in full suite runs on a loaded 2-core machine it reached 24.5 MB
# (1.10x) in about one run of three: the in-flight memory of context parallelism's backward, which the cost
# model does not bound yet (OVER_PROMISE above). test_context2_peak_is_within_the_plans_promise... stays in CI.
@pytest.mark.heavy
def test_where_only_context_parallelism_fits_the_search_picks_it_and_the_run_keeps_its_promise():
    per_rank = launch("context_memory_worker.py", [LONG, dict(LONG, budget_mib=None, fixed=["context=1"])], 2)
    for rank, (context, data) in enumerate(per_rank):
        assert context["ok"] and data["ok"], (context.get("trace"), data.get("trace"))
        assert context["context"] == 2 and "no layout without context parallelism fits" in context["why"], rank
        assert context["required_bytes"] <= context["budget_bytes"] < data["required_bytes"], rank
        # Measured 0.70-0.97x of the promise over runs; the data-parallel plan's step peak is 3x higher.
        promise = context["predicted_bytes"]
        assert 0.6 * promise <= context["measured"]["peak_bytes"] <= OVER_PROMISE * promise, rank
        assert context["measured"]["peak_bytes"] < data["measured"]["peak_bytes"], rank
