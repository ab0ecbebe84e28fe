"""Sharded checkpoints on 2 gloo ranks: N steps straight == N/2 + save + fresh setup + load + N/2.

Bitwise: the resumed run's per-rank losses and final full weights equal the straight run's exactly
(same plan layout: master shards, optimizer state, step counts, loss scale and RNG are restored).
Also: another chunk size falls back to model.pt with a warning; another model is a clear error; a
save that died between its renames leaves a complete copy that load finds.
"""

from __future__ import annotations

import pytest

from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CASES = [
    # AdamW over device and host shards, recomputation, accumulation, clipping.
    dict(model="gpt2", chunk_size=4096, cache="min", offload=0.5, prefetch=2, checkpoint=1, accum=2, clip=0.5, steps=6),
    # fp16 (loss scaler, a skipped step before the save), SGD momentum, a frozen parameter, tied weights.
    dict(
        model="tied",
        chunk_size=1024,
        cache="all",
        offload=1.0,
        optimizer="sgd",
        dtype="fp16",
        plant_inf_step=1,
        steps=6,
    ),
]


def test_resume_is_exact_and_fallbacks_are_clear():
    per_rank = launch("engine_checkpoint_worker.py", CASES, world_size=2, timeout_s=120)
    for rank, results in enumerate(per_rank):
        for case, result in zip(CASES, results, strict=True):
            assert result["ok"], (rank, result.get("error"), result.get("trace"))
            assert result["exact"] and result["step"] == case["steps"] // 2
            assert result["extra"] == {"note": "half"}
            assert result["resumed"] == result["straight"], (rank, case)  # bitwise
            assert result["same_weights"], (rank, case)
            assert result["skipped"][0] == result["skipped"][1]
            assert result["scales"][0] == result["scales"][1]
            assert result["saved"] == f"step-{case['steps'] // 2:06d}" == result["latest"]
            assert result["files"] == ["meta.json", "model.pt", "rank-00000.pt", "rank-00001.pt"]
            assert result["leftovers"] == []  # no temporary or old directory left behind, the stale one removed
        fp16 = results[1]
        assert sum(fp16["skipped"][0]) == 1  # the planted overflow happened before the save
        first = results[0]
        assert first["fallback_exact"] is False
        assert "could NOT be restored" in first["fallback_warning"] and "chunk size" in first["fallback_warning"]
        assert first["fallback_weights"] and first["model_pt_weights"]
        assert "another model" in first["mismatch_error"]
        assert "not a complete" in first["missing_error"]
        assert first["renamed_exact"] and first["renamed_weights"]
