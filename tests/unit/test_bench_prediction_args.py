"""scripts/bench_prediction.py's --hardware FILE (probe once, predict alike) and the sensitivity script's
reading of a bench result's spec; no training runs."""

from __future__ import annotations

import json
import sys

import pytest

from elixir_tune import paths

sys.path.insert(0, str(paths.REPO_DIR / "scripts"))
import bench_prediction  # noqa: E402
from bench_prediction_sensitivity import FIGURES, scaled, spec_of  # noqa: E402

RESULTS = paths.REPO_DIR / "benchmarks" / "results"


def _main(monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["bench_prediction.py", *argv])
    return bench_prediction.main()


def test_a_missing_hardware_file_is_a_usage_error_that_says_how_to_write_one(monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _main(monkeypatch, "--layouts", "--hardware", str(tmp_path / "hw.yaml"))
    assert exit_info.value.code == 2
    assert "no such file; write one with `elixir-tune probe --out FILE`" in capsys.readouterr().err


def test_hardware_and_preset_exclude_each_other(monkeypatch, tmp_path, capsys):
    spec = tmp_path / "hw.yaml"
    spec.write_text("name: x\n")
    with pytest.raises(SystemExit) as exit_info:
        _main(monkeypatch, "--preset", "--hardware", str(spec))
    assert exit_info.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


def test_a_hardware_file_that_is_no_spec_is_refused_before_anything_runs(monkeypatch, tmp_path, capsys):
    spec = tmp_path / "hw.yaml"
    spec.write_text("name: x\nnot_a_field: 1\n")
    assert _main(monkeypatch, "--layouts", "--hardware", str(spec), "--out", str(tmp_path / "out.json")) == 2
    err = capsys.readouterr().err
    assert "--hardware:" in err and "not_a_field" in err
    assert not (tmp_path / "out.json").exists()


def test_a_bench_result_gives_back_the_spec_its_run_predicted_with():
    path = RESULTS / "prediction-cpu-layouts.json"
    spec, recorded = spec_of(str(path))
    assert set(recorded) == {"data-only", "pipeline-2", "tensor-2"}
    hardware = json.loads(path.read_text())["hardware"]  # the figures the run predicted with
    assert spec.collective_latency_s == pytest.approx(hardware["collective_latency_s"])
    assert spec.tensor2_block_extra_ratio == pytest.approx(hardware["tensor2_block_extra_ratio"])
    assert all(isinstance(n, int) for n in spec.block_tflops_curves["fp32"])
    # Scaling a figure changes it and nothing else the cost model reads.
    for figure in FIGURES:
        changed = scaled(spec, figure, 1.5)
        if figure == "block_tflops_curves":
            assert max(changed.model_tflops.values()) == pytest.approx(1.5 * max(spec.model_tflops.values()))
        else:
            assert getattr(changed, figure) == pytest.approx(1.5 * getattr(spec, figure))
        others = [f for f in FIGURES if f != figure and f != "block_tflops_curves"]
        assert all(getattr(changed, f) == getattr(spec, f) for f in others)


def test_the_report_states_how_the_machines_speed_moved_over_the_runs():
    from bench_prediction_report import speed_note

    runs = [{"plain_fwd_bwd_8x1_before_s": t} for t in (0.225, 0.300)]
    record = {"shapes": [{"measured": {"runs": runs}}, {"measured": {"runs": [{"plain_fwd_bwd_8x1_before_s": 0.356}]}}]}
    assert "each of the 3 runs" in speed_note(record) and "225.0-356.0 ms (median 300.0)" in speed_note(record)
    assert speed_note({"shapes": [{"measured": {"runs": [{}]}}]}) == ""  # a record from before
