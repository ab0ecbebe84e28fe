"""The published setups scripts/bench_published.py compares with: consistent with their quoted rows.

No search runs here (the script's full table takes minutes): these check the data the comparison
rests on, the Megatron-LM conversion from TFLOP/s to tokens/s, and the script's filters.
"""

from __future__ import annotations

import sys

import pytest

from elixir_tune import paths

sys.path.insert(0, str(paths.REPO_DIR / "scripts"))
import bench_published  # noqa: E402
import published_setups  # noqa: E402
from published_setups import PUBLISHED, SOURCE_KEYS, megatron_tokens_per_s  # noqa: E402

from elixir_tune.hardware import load_hardware  # noqa: E402


@pytest.mark.parametrize("setup", PUBLISHED, ids=lambda setup: setup.name)
def test_every_setup_is_a_configuration_a_plan_can_pin(setup):
    assert setup.source and setup.row and setup.mismatches
    assert setup.source_key in SOURCE_KEYS
    hardware = load_hardware(setup.hardware)
    assert setup.dtype in hardware.matmul_tflops
    assert setup.gpus_per_node <= hardware.gpus_per_node
    assert setup.gpus % (setup.tensor * setup.pipeline) == 0
    data = setup.gpus // (setup.tensor * setup.pipeline)
    assert setup.global_batch_size == setup.micro_batch_size * setup.grad_accum_steps * data
    if setup.gpt is not None:
        hidden, layers, heads, _, _ = setup.gpt
        assert hidden % heads == 0 and heads % setup.tensor == 0 and layers % setup.pipeline == 0
    pinned = bench_published.pinned_choices(setup)
    assert pinned["accumulation"] == ("standard" if setup.pipeline == 1 else "layered")
    assert pinned.get("assignment") == (setup.assignment if setup.pipeline > 1 else None)


def test_megatron_pipelines_pin_the_assignment_nearest_their_schedule():
    # 39B: plain 1F1B, one run of 24 layers per stage -> contiguous (1F1B's bubble, 1 / 13 of the step);
    # 76B: interleaved with 5 layers per virtual stage, which no plan expresses -> modular, stated.
    by_name = {setup.name: setup for setup in PUBLISHED}
    plain, interleaved = by_name["Megatron GPT-39B 512xA100 (t8 p2)"], by_name["Megatron GPT-76B 1024xA100 (t8 p4)"]
    assert bench_published.pinned_choices(plain)["assignment"] == "contiguous"
    assert bench_published.pinned_choices(interleaved)["assignment"] == "modular"
    assert interleaved.grad_accum_steps == 28
    # (P - 1) / (v N + P - 1) with v = 60 / (4 x 5) = 3 runs per rank: 3 / 87.
    assert any("= 3.4% of the step" in text for text in interleaved.mismatches)


def test_megatron_rows_reproduce_their_published_percent_of_peak():
    """Tokens/s back to TFLOP/s with eq. 3 gives the row's TFLOP/s, whose share of 312 is its quoted %."""
    megatron = [setup for setup in PUBLISHED if setup.source_key == "megatron"]
    assert len(megatron) == 6
    for setup in megatron:
        hidden, layers, _, vocab, flash = setup.gpt
        assert vocab == 51200 and not flash and setup.seq_len == 2048 and setup.dtype == "fp16"
        tflops = int(setup.row.split(" TFLOP/s")[0].rsplit("| ", 1)[1])
        percent = int(setup.row.split("% of peak")[0].rsplit("| ", 1)[1])
        assert tflops / 312 == pytest.approx(percent / 100, abs=0.006)
        assert setup.tokens_per_s_per_gpu == pytest.approx(megatron_tokens_per_s(tflops, layers, hidden))
    # The 1.7B row by hand: 96 x 24 x 2304^2 x (1 + 2048 / 13824 + 51200 / 884736) FLOPs per token.
    per_token = 96 * 24 * 2304**2 * (1 + 2048 / 13824 + 51200 / 884736)
    assert megatron_tokens_per_s(137, 24, 2304) == pytest.approx(137e12 / per_token)


def test_only_the_llm_foundry_rows_share_a_source_with_the_fitted_rates():
    fitted = {setup.source_key for setup in PUBLISHED if setup.fitted_source}
    assert fitted == {"llm-foundry"}
    assert {"megatron", "zero-offload", "torchtitan"} <= set(SOURCE_KEYS)


def test_filters_select_by_source_and_by_name():
    assert all(setup.source_key == "megatron" for setup in bench_published.selected("megatron", ""))
    chosen = bench_published.selected("", "MPT-7b,ZeRO")
    assert {setup.name for setup in chosen} == {
        setup.name for setup in PUBLISHED if "MPT-7b" in setup.name or "ZeRO" in setup.name
    }
    with pytest.raises(SystemExit, match="unknown"):
        bench_published.selected("nosuchsource", "")
    with pytest.raises(SystemExit, match="no setup"):
        bench_published.selected("", "no such row")
    assert published_setups.LEFT_OUT  # sources looked at and left out are reported with a reason


def test_a_speedup_reason_names_the_choices_and_the_parts_that_shrink():
    pinned = {
        "shape": {"micro_batch_size": 16, "checkpointing": 1, "offload": 0.0, "accumulation": "standard"},
        "layout": "tp2",
        "step_time_s": 4.0,
        "breakdown": {"compute_s": 3.0, "recompute_s": 0.8, "tensor_comm_s": 0.2},
    }
    free = {
        "shape": {"micro_batch_size": 2, "checkpointing": 0, "offload": 0.0, "accumulation": "standard"},
        "layout": "dp only",
        "step_time_s": 2.5,
        "breakdown": {"compute_s": 2.4, "recompute_s": 0.0, "tensor_comm_s": 0.0},
    }
    reason = bench_published.speedup_reason(pinned, free)
    assert reason.startswith("micro_batch_size 16 -> 2; checkpointing 1 -> 0; layout tp2 -> dp only: ")
    assert reason.index("recompute_s") < reason.index("compute_s 3") < reason.index("tensor_comm_s")
