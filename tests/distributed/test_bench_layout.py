"""The CPU layout ratios measured for real (hardware/bench_layout.py): 2 gloo processes, a tiny block."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.distributed
def test_layout_ratios_come_from_real_timings():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "elixir_tune.hardware.bench_layout",
            "--repeats",
            "1",
            "--shape",
            "4,16,32,2",
            "--tiny-shape",
            "4,2,8,2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    (measured,) = result["rounds"]
    for key in ("plain_block_s", "micro_batch_s", "pipeline2_s", "tensor2_block_s"):
        assert 0 < measured[key] < 10, key
    # A rank runs 2 blocks for each of 4 micro-batches: the step takes several micro-batch calls.
    assert measured["pipeline2_s"] > 2 * measured["micro_batch_s"]
    # Half the block's work plus collectives and DTensor dispatch: more than half the plain block
    # (on a block this small the dispatch alone is many times the block: 31x was seen).
    assert measured["tensor2_block_s"] > measured["plain_block_s"] / 2
    assert measured["tensor2_block_extra_ratio"] > 0 or measured["tensor2_block_fixed_s"] > 0
    # The tiny block's times are measured too, and the fixed costs fitted from both shapes.
    assert 0 < measured["tiny_tensor2_block_s"] < 10 and 0 < measured["tiny_pipeline2_s"] < 10
    for key in ("tensor2_block_fixed_s", "pipeline_stage_microbatch_s"):
        assert math.isfinite(measured[key]), key
    assert all(math.isfinite(v) for v in result["median"].values())


def test_a_bad_shape_is_refused(capsys):
    # main() in this process: the argument checks run before any worker starts; the module's own entry
    # point (``python -m``) is what the test above starts.
    from elixir_tune.hardware.bench_layout import main

    for argv, message in (
        (["--shape", "3,16,32"], "--shape: expected 4 integers"),
        (["--tiny-shape", "4,2,9,2"], "--tiny-shape 4,2,9,2: batch must divide"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
