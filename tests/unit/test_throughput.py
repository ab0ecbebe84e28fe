"""Which tokens a step learned from (padding and no-loss positions apart), and the plan's promise against a run."""

from __future__ import annotations

import torch

from elixir_tune.data.packing import packed_rows, padded_rows
from elixir_tune.recipes.throughput import GAP_LIMIT, compare, step_figures, token_counts

PAD = 0
# (input ids, labels): a prompt of 3 tokens (-100) and a completion of 2, a text sample learned whole, one of 6
PROMPTED = ([5, 6, 7, 8, 9], [-100, -100, -100, 8, 9])
TEXT = ([3, 4, 5], [3, 4, 5])
LONG = ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6])


def test_padded_rows_count_padding_by_the_mask_and_learned_tokens_by_the_shifted_labels():
    batch = padded_rows([PROMPTED, TEXT], 8, PAD)
    computed, padding, learned = token_counts(batch, PAD).tolist()
    assert computed == 16
    assert padding == (8 - 5) + (8 - 3)
    # row 0 learns its 2 completion tokens; row 1 its tokens after the first (nothing predicts position 0)
    assert learned == 2 + 2


def test_packed_rows_count_the_tail_after_the_last_sample_as_padding():
    batch = packed_rows([[PROMPTED, TEXT], [LONG, TEXT]], 10, PAD)
    computed, padding, learned = token_counts(batch, PAD).tolist()
    assert computed == 20
    assert padding == (10 - 8) + (10 - 9)
    assert learned == (2 + 2) + (5 + 2)  # each sample's first label never counts in a packed row
    full = packed_rows([[LONG, ([7, 7, 7, 7], [7, 7, 7, 7])]], 10, PAD)  # exactly full: no padding at all
    assert token_counts(full, PAD).tolist() == [10, 0, 5 + 3]


def test_batches_without_labels_or_mask_learn_from_every_position():
    ids = torch.ones(2, 4, dtype=torch.long)
    assert token_counts({"input_ids": ids}).tolist() == [8, 0, 8]
    assert token_counts({"input_ids": ids, "labels": ids}).tolist() == [8, 0, 6]


def test_rates_and_mfu_come_from_the_learned_tokens():
    figures = step_figures(torch.tensor([1000.0, 600.0, 100.0], dtype=torch.float64), 0.5, 10**6, 2, 0.01)
    assert figures["tokens"] == 100 and figures["tokens_padding"] == 600 and figures["tokens_no_loss"] == 300
    assert figures["tokens_per_s"] == 200 and figures["computed_tokens_per_s"] == 2000
    assert figures["tflops_per_gpu"] == 6 * 10**6 * 100 / 0.5 / 2 / 1e12
    assert abs(figures["mfu"] - figures["tflops_per_gpu"] / 0.01) < 1e-15
    assert step_figures(torch.tensor([8.0, 0.0, 8.0], dtype=torch.float64), 1.0, 10, 1, None)["mfu"] is None


def test_a_gap_beyond_the_limit_says_what_to_do_and_a_close_run_says_nothing():
    header = {"predicted_step_time_s": 0.1, "predicted_peak_memory_bytes": 1000, "hardware": "a100-80gb-sxm"}
    close = compare(header, 0.1 * GAP_LIMIT * 0.99, 1000, "cuda")
    assert close["advice"] == [] and abs(close["step_time_ratio"] - GAP_LIMIT * 0.99) < 1e-12
    slow = compare(header, 0.2, 2000, "cuda")
    assert slow["step_time_ratio"] == 2.0 and slow["memory_ratio"] == 2.0
    time_advice, memory_advice = slow["advice"]
    assert time_advice.startswith("steps ran 2.0x slower than predicted; the plan was made for a100-80gb-sxm")
    assert "elixir-tune probe" in time_advice and "search --hardware hardware.yaml" in memory_advice
    fast = compare(header, 0.05, 1000, "cuda")
    assert fast["advice"][0].startswith("steps ran 2.0x faster than predicted")
    # On the CPU the growth past the libraries: within the 256 MiB kept free beside the plan, no advice
    runtime = compare(header, 0.1, 200 * 2**20, "cpu")
    assert runtime["memory_ratio"] > GAP_LIMIT and runtime["advice"] == []
    cpu = compare(header, 0.1, 2 * 2**30, "cpu")
    assert "grew by more than the plan's tensors and the 256 MiB" in cpu["advice"][0]
    none = compare({}, 0.1, 1000, "cpu")
    assert none["step_time_ratio"] is None and none["memory_ratio"] is None and none["advice"] == []


def test_cpu_memory_is_measured_above_what_no_plan_counts():
    """Issue 50: the demo compared the plan's 21 MiB with the whole process's 403 MiB (18.9x)."""
    from torch import nn

    from elixir_tune.recipes import loop

    device = torch.device("cpu")
    model = nn.Linear(1024, 1024)  # 4 MiB of weights: counted by the plan, so kept in the growth
    loop.mark_process_start(model)
    assert 0 <= loop.memory_bytes(device) < loop.resident_bytes()
    held = torch.ones(64 * 2**20 // 4)  # 64 MiB more, touched
    assert loop.memory_bytes(device) >= 64 * 2**20
    del held
