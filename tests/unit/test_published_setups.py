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
import published_left_out  # noqa: E402
from published_colossalai import gpt2_params  # noqa: E402
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
    # 76B: interleaved with 5 layers per virtual stage, which no plan expresses -> contiguous 1F1B (its
    # memory; the modular plan's looped schedule holds every micro-batch), stated.
    by_name = {setup.name: setup for setup in PUBLISHED}
    plain, interleaved = by_name["Megatron GPT-39B 512xA100 (t8 p2)"], by_name["Megatron GPT-76B 1024xA100 (t8 p4)"]
    assert bench_published.pinned_choices(plain)["assignment"] == "contiguous"
    assert bench_published.pinned_choices(interleaved)["assignment"] == "contiguous"
    assert bench_published.pinned_choices(interleaved)["schedule"] == "1f1b"
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
    assert {"megatron", "zero-offload", "torchtitan", "colossalai-pl", "colossalai-gemini"} <= set(SOURCE_KEYS)


def test_gemini_rows_reproduce_their_tflops_with_the_profiles_parameter_count():
    """Colossal-AI's TFLOPS = batch x params x 1024 x 8 / step time, params as model.parameters() sums them."""
    rows = [setup for setup in PUBLISHED if setup.source_key == "colossalai-gemini"]
    assert len(rows) == 7
    for setup in rows:
        cells = [cell.strip() for cell in setup.row.split(";")[0].split("|")[1:-1]]
        model, gpus, policy, tp, batch, tflops = cells[:6]
        assert (int(gpus), int(tp), int(batch)) == (setup.gpus, 1, setup.micro_batch_size)
        # Every policy but 'cuda' keeps the fp32 master and Adam on the host (ZeroDDP's cpu_offload); Gemini
        # fetches synchronously (prefetch 0); 'auto' keeps every gathered fp16 chunk on the 80 GB card.
        assert setup.offload == 1.0 and setup.prefetch == 0 and not setup.first_step_in_window
        assert setup.cache_blocks == ("all" if policy == "auto" else None)
        pinned = bench_published.pinned_choices(setup)
        assert pinned["offload"] == 1.0 and pinned["prefetch"] == 0
        assert pinned.get("cache_blocks") == setup.cache_blocks
        params = bench_published.profile_of(setup).num_params
        assert params == gpt2_params(*setup.gpt[:2])  # the analytic profile counts what the script counted
        assert setup.tokens_per_s_per_gpu * 8 * params == pytest.approx(float(tflops) * 1e12)
    # The 10B row at batch 32 by hand: 122.046 TFLOPS / (8 x 10,279,047,168) = 1484.2 tokens/s per GPU.
    assert gpt2_params(4096, 50) == 50 * (12 * 4096**2 + 13 * 4096) + (50257 + 1024) * 4096 + 2 * 4096
    assert rows[0].tokens_per_s_per_gpu == pytest.approx(1484.2, abs=0.1)


def test_colossalai_rows_reproduce_their_quoted_figures():
    """Step time rows: 1024 tokens per GPU per step; throughput rows: samples/s x 1024 over 4 GPUs."""
    rows = [setup for setup in PUBLISHED if setup.source_key == "colossalai-pl"]
    assert len(rows) == 7
    for setup in rows:
        cells = [cell.strip() for cell in setup.row.split(";")[0].split("|")[1:-1]]
        assert setup.seq_len == 1024 and setup.dtype == "fp16" and setup.checkpointing == "all"
        assert setup.hardware == "a100-40gb-sxm" and not setup.gpt[4]  # eager attention
        if "--epochs 1" in setup.row:  # model scaling: | strategy | GPUs | B | MB | s |
            assert int(cells[1]) == setup.gpus and setup.micro_batch_size == 1
            assert setup.tokens_per_s_per_gpu == pytest.approx(1024 / float(cells[4]))
        else:  # small model comparison: | strategy | global batch | samples/s | MB |, 4 GPUs
            assert int(cells[1]) == setup.global_batch_size and setup.gpus == 4
            assert setup.tokens_per_s_per_gpu == pytest.approx(float(cells[2]) * 1024 / 4)
        # Offloading is pinned where the strategy fixes it, and left to the search for Gemini's 'auto'.
        expected = 1.0 if "offload" in cells[0] else None if "auto" in cells[0] else 0.0
        assert setup.offload == expected
        # Gemini fetches synchronously; DeepSpeed and DDP overlap (the search picks the prefetch).
        assert setup.prefetch == (0 if "colssalai" in cells[0] else None)
        # The figure is the progress bar's average over the last epoch: with one epoch of 3 steps it
        # holds the run's first step; with the defaults (2 epochs of 4) it does not.
        assert setup.first_step_in_window == ("--epochs 1 --steps_per_epoch 3" in setup.row)
    # The 18B row by hand: one 1024-token sample per step of 39.32 s.
    assert rows[0].name == "GPT-2 18B 1xA100-40G (ZeRO-3 offload)"
    assert rows[0].tokens_per_s_per_gpu == pytest.approx(26.04, abs=0.01)


def test_merging_parts_keeps_every_command_and_the_last_row_of_a_setup():
    def part(command, names, elapsed_s, ratio=1.1, parts=None):
        rows = [{"name": name, "ratio": ratio, "defines_bound": False, "free": {}} for name in names]
        return {"command": command, "elapsed_s": elapsed_s, "rows": rows, **({"parts": parts} if parts else {})}

    # The last setup here: Gemini 20B, its figure printed twice (out of scope).
    first, last = PUBLISHED[0].name, "GPT-2 20B 1xA100-80G-PCIe (Gemini cpu, batch 8)"
    whole = part("python scripts/bench_published.py", [first, last], 100.0, parts=["cmd a", "cmd b"])
    report = bench_published.merged([part("cmd c", [last], 40.0), whole], note="n")
    assert report["parts"] == ["cmd c", "cmd a", "cmd b"]
    assert [row["name"] for row in report["rows"]] == [first, last]  # table order, not part order
    assert report["elapsed_s"] == 100.0 and report["note"] == "n"
    # The last setup (Gemini 20B, its figure printed twice) is out of scope: summarised apart.
    assert report["summary"]["compared"] == 1 and report["summary"]["out_of_scope"]["compared"] == 1
    # A rerun of some rows merged after the table replaces them; a repeated command is listed once.
    rerun = bench_published.merged([whole, part("cmd b", [last], 5.0, ratio=0.9)], note="")
    assert rerun["replaced"] == [last] and rerun["parts"] == ["cmd a", "cmd b"]
    assert [row["ratio"] for row in rerun["rows"]] == [1.1, 0.9]


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
    assert published_left_out.LEFT_OUT  # sources looked at and left out are reported with a reason


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


def test_rows_whose_window_holds_the_first_step_are_summarised_apart():
    def row(name, ratio, first_step=False):
        return {
            "name": name,
            "ratio": ratio,
            "defines_bound": False,
            "first_step_in_window": first_step,
            "published_tokens_per_s_per_gpu": 100.0,
            "pinned": {},
            "free": {"error": "none"},
        }

    rows = [row("a", 1.02), row("b", 0.95), row("c", 1.3), row("d", 14.0, True), row("e", 2.0, True)]
    summary = bench_published.summary(rows)
    # Out of scope (issue 38): left out of the summary's own figures, reported on their own line.
    assert summary["compared"] == 3 and summary["beyond_25pct"] == 1
    assert summary["median_abs_error"] == pytest.approx(0.05)
    assert summary["out_of_scope"]["compared"] == 2 and summary["out_of_scope"]["beyond_25pct"] == 2
    # Rows of an older report carry no flag: they count as in scope.
    del rows[0]["first_step_in_window"]
    assert bench_published.summary(rows)["compared"] == 3
    assert "`f`" in bench_published.table_row(rows[3]) and "`f`" not in bench_published.table_row(rows[0])


def test_a100_40gb_rows_reproduce_their_printed_mfu():
    """llm-foundry's MFU = (6 x params + 12 x layers x d_model x seq) x tokens/s / 312 TFLOP/s, params of
    MPT's shape (12 x layers x d_model^2 + vocab x d_model, ALiBi: no position table): each added row's
    quoted figures agree with each other to 2% (norms and biases left out), and none is the row the preset's best MFU quotes."""
    rows = [setup for setup in PUBLISHED if setup.source_key == "llm-foundry-40gb"]
    assert len(rows) >= 10 and not any(setup.fitted_source or setup.defines_bound for setup in rows)
    for setup in rows:
        hidden, layers, _, vocab, _ = setup.gpt
        params = 12 * layers * hidden**2 + vocab * hidden
        flops_per_token = 6 * params + 12 * layers * hidden * setup.seq_len
        mfu = float(setup.row.split("MFU ")[1].split(" ")[0]) / 100
        assert flops_per_token * setup.tokens_per_s_per_gpu / 312e12 == pytest.approx(mfu, rel=0.02)
        assert setup.hardware == "a100-40gb-sxm"


@pytest.mark.slow
@pytest.mark.heavy
def test_gpt2_xl_zero3_peak_is_near_what_its_source_measured():
    """ColossalAI-Pytorch-lightning's GPT-2 XL under DeepSpeed ZeRO-3 at 40 samples per GPU: its README
    measured 25360.968 MB allocated at most. The pinned plan, profiled from the peer's own model file (the
    loss on the fp16 logits), is predicted within 10% of it and fits the 40 GB card."""
    setup = next(setup for setup in PUBLISHED if setup.name == "GPT-2 XL 4xA100-40G (ZeRO-3)")
    measured_gib = float(setup.row.split("|")[4]) * 2**20 / 2**30  # "| deepspeed (zero3) | 160 | 18.18 | 25360.968 |"
    result = bench_published.best_plan(bench_published.profile_of(setup), setup, bench_published.pinned_choices(setup))
    assert not result.get("over_usable_memory") and "error" not in result
    assert result["peak_gpu_gib"] == pytest.approx(measured_gib, rel=0.10)


def test_torchtitan_h100_rows_compare_with_the_96gb_cards_they_ran_on():
    """torchtitan's H100s had 96 GB: its rows borrow h100-80gb-sxm's rates and take 96e9 bytes less the same
    CUDA context as usable memory."""
    from published_peer_models import card_memory
    from published_setups import H100_96GB_BYTES

    base = load_hardware("h100-80gb-sxm")
    card = card_memory("h100-80gb-sxm", H100_96GB_BYTES)
    assert card.usable_memory_bytes == H100_96GB_BYTES - (base.gpu_memory_bytes - base.usable_memory_bytes)
    assert card.matmul_tflops == base.matmul_tflops and card.block_tflops_curves == base.block_tflops_curves
    titan = [setup for setup in PUBLISHED if setup.source_key == "torchtitan"]
    assert titan and all(setup.card_memory_bytes == H100_96GB_BYTES for setup in titan)
