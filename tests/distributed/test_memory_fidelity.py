"""What a training step really allocates against what the plan predicts, measured without asking
the engine (``memory_probe``), for GPT-2 and Llama tiny at world 2 on gloo; and the engine's live
cache against the cost model's simulated one (gathers and host->device uploads of one step).

On a CPU plan device and host are one pool: the prediction compared is the device peak plus this
rank's share of the node's host peak. The prediction must never be under the measurement, and at
most 15% over it.

GPT-2 tiny with GPT-2's attention dropout (``gpt2_dropout.yaml``), without and with checkpointing: the CPU
runs its attention on the math path, which keeps the scores (``memory.cpu_attention_dropout_bytes``).

Issue 23's GPT-2 of 12.8M parameters (``gpt2_13m.yaml``, ``offload=1 cache_blocks=2 prefetch=1``,
micro-batch 4, fp32, the search's chunk size) at offload 0, 0.5 and 1, in the same launch: on a CPU
device an offloaded chunk holds what a device chunk holds (its fp32 master is its upload copy, its
reduced gradient is added without a landing buffer), so the measured peak is the same at every
offload share and must lie within 0.85-1.0x of the prediction.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.engine_launch import launch

MAX_OVER = 1.15


def shape(offload: float, cache: str, prefetch: int, checkpointing: str, mb: int, accum: int, dtype: str) -> dict:
    fixed = dict(offload=offload, cache_blocks=cache, prefetch=prefetch, checkpointing=checkpointing)
    return dict(fixed=fixed, micro_batch_size=mb, accum=accum, dtype=dtype)


# offload none / half / all, cache all / minimum, prefetch 2, checkpointing all, accumulation 4, fp32 and bf16
SHAPES = [
    shape(0.0, "all", 0, "none", mb=2, accum=1, dtype="fp32"),
    shape(0.5, "min", 2, "all", mb=1, accum=4, dtype="fp32"),
    shape(1.0, "min", 0, "all", mb=2, accum=1, dtype="bf16"),
    shape(0.0, "min", 2, "none", mb=2, accum=2, dtype="bf16"),
    shape(0.5, "all", 0, "all", mb=2, accum=1, dtype="fp32"),
    shape(1.0, "all", 2, "none", mb=1, accum=4, dtype="bf16"),
]
CASES = [dict(s, model=model) for model in ("gpt2-tiny", "llama-tiny") for s in SHAPES]
GPT2_13M = str(Path(__file__).with_name("gpt2_13m.yaml"))
OFFLOAD_SHARES = (0.0, 0.5, 1.0)
CASES += [
    dict(shape(offload, 2, 1, "none", mb=4, accum=1, dtype="fp32"), model=GPT2_13M, chunk_size=None)
    for offload in OFFLOAD_SHARES
]
ONE_POOL_RANGE = (0.85, 1.0)  # measured / predicted, GPT-2 13M
# GPT-2 with attention dropout: on the CPU its attention keeps the scores (math path), all blocks or one recomputing.
GPT2_DROPOUT = str(Path(__file__).with_name("gpt2_dropout.yaml"))
CASES += [
    dict(shape(0.0, "all", 0, checkpointing, mb=2, accum=1, dtype="fp32"), model=GPT2_DROPOUT)
    for checkpointing in ("none", "all")
]


@pytest.fixture(scope="module")
def results():
    return launch("memory_fidelity_worker.py", CASES, world_size=2, timeout_s=400)


def _label(case: dict) -> str:
    model = Path(case["model"]).stem
    return f"{model} {case['dtype']} {case['fixed']} mb={case['micro_batch_size']} accum={case['accum']}"


@pytest.mark.slow
@pytest.mark.distributed
def test_predicted_peak_covers_the_measured_one_within_15_percent(results):
    rows = []
    for rank, per_case in enumerate(results):
        for result in per_case:
            assert result["ok"], (rank, result.get("error"), result.get("trace"))
            measured = result["measured"]["peak_bytes"]
            predicted = result["predicted_gpu_bytes"] + result["predicted_host_bytes_per_rank"]
            detail = (
                f"live {result['measured']['live_bytes']} (engine report {result['report_bytes']}) + step "
                f"{result['measured']['step_peak_bytes']} (activations {result['predicted_activation_bytes']} + "
                f"buffers {result['predicted_buffer_bytes']})"
            )
            rows.append((_label(result["case"]), rank, measured, predicted, predicted / measured, detail))
    table = "\n".join(
        f"{label} rank {rank}: measured {m} predicted {p} ({r:.3f}x): {d}" for label, rank, m, p, r, d in rows
    )
    print(table)  # pytest -s shows the figures
    assert all(m <= p for _, _, m, p, _, _ in rows), table
    assert all(r <= MAX_OVER for *_, r, _ in rows), table


@pytest.mark.slow
@pytest.mark.distributed
def test_live_cache_gathers_and_uploads_equal_the_simulation(results):
    """Gathers are equal in every case; uploads too, except where prefetch meets recomputation in a
    cache smaller than the model (GPT-2's ``mb=1 accum=4`` shape: 40 vs 37 per step): there the
    engine and the simulation break ties between chunks used at the same step differently, so the
    same number of gathers falls on other chunks (some offloaded). Printed under pytest -s."""
    differ = []
    for per_case in results:
        for result in per_case:
            assert result["ok"], (result.get("error"), result.get("trace"))
            engine, simulated, plan = result["engine_counts"], result["simulated_counts"], result["plan"]
            known_gap = plan["prefetch"] > 0 and plan["every"] > 0 and plan["cache_blocks"] < plan["chunks"] - 1
            if engine["gathers"] != simulated["gathers"] or (
                engine["uploads"] != simulated["uploads"] and not known_gap
            ):
                differ.append((_label(result["case"]), plan, engine, simulated))
            if known_gap:
                print("prefetch + recomputation, small cache:", _label(result["case"]), engine, simulated)
                assert abs(engine["uploads"] - simulated["uploads"]) <= 0.1 * simulated["uploads"]
    assert not differ, "\n".join(map(str, differ))


@pytest.mark.slow
@pytest.mark.distributed
def test_offload_costs_nothing_on_a_cpu_device_and_the_one_pool_is_predicted(results):
    """GPT-2 13M at offload 0, 0.5 and 1: measured peak within 0.85-1.0x of the prediction (device
    part plus this rank's host part), and offloading adds nothing, predicted or measured."""
    low, high = ONE_POOL_RANGE
    peaks: dict[float, list[int]] = {}
    predictions: dict[float, list[int]] = {}
    rows = []
    for rank, per_case in enumerate(results):
        for result in per_case:
            case = result["case"]
            if case["model"] != GPT2_13M:
                continue
            assert result["ok"], (rank, result.get("error"), result.get("trace"))
            offload = case["fixed"]["offload"]
            measured = result["measured"]["peak_bytes"]
            predicted = result["predicted_gpu_bytes"] + result["predicted_host_bytes_per_rank"]
            peaks.setdefault(offload, []).append(measured)
            predictions.setdefault(offload, []).append(predicted)
            rows.append(f"offload {offload} rank {rank}: measured {measured} predicted {predicted} "
                        f"({measured / predicted:.3f}) plan {result['plan']}")  # fmt: skip
    table = "\n".join(rows)
    print(table)
    assert sorted(peaks) == list(OFFLOAD_SHARES), table
    pairs = [(m, p) for offload in peaks for m, p in zip(peaks[offload], predictions[offload], strict=True)]
    assert all(low * p <= m <= high * p for m, p in pairs), table
    assert len({p for ps in predictions.values() for p in ps}) == 1, table  # offload adds no predicted byte
    fewest, most = min(min(v) for v in peaks.values()), max(max(v) for v in peaks.values())
    assert most - fewest <= 4 << 20, table  # nor a measured one (4 MiB: allocator noise)
