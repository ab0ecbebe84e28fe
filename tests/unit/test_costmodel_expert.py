"""The cost model's expert-parallel all-to-all bytes (costmodel/expert.py)."""

from __future__ import annotations

from elixir_tune.costmodel.expert import expert_all_to_all_bytes


def test_no_expert_parallelism_moves_nothing():
    assert expert_all_to_all_bytes(1, 4096, 2048, 8, 48, 2) == 0


def test_bytes_follow_the_rows_that_leave_the_rank():
    # E = 2: half of the 16 x 2 rows leave, 4 all-to-alls per block, 3 blocks, hidden 32, fp32.
    assert expert_all_to_all_bytes(2, 16, 32, 2, 3, 4) == 4 * 3 * (16 * 2 // 2) * 32 * 4
    # A larger group sends a larger share away: (E - 1) / E.
    assert expert_all_to_all_bytes(8, 16, 32, 2, 3, 4) == 4 * 3 * (16 * 2 * 7 // 8) * 32 * 4
