"""Checkpoint faults on 2 real gloo ranks: nothing in a file runs, damage is found and named, a bad
save never replaces a good checkpoint, a second writer is refused, a full disk leaves nothing behind.

Every error must reach both ranks as the same one-line CheckpointError (the ranks agree before
raising, so none waits in a collective for the other), and name the file and what is wrong.
"""

from __future__ import annotations

import re

import pytest

from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

HARMS = [
    "pickle",
    "pickle_old_format",
    "corrupt",
    "corrupt_model",
    "truncated",
    "missing",
    "garbled_meta",
    "old_format",
    "meta_step_edited",
    "meta_fingerprint_edited",
    "meta_step_text",
    "other_model",
    "nan",
    "no_space",
    "write_fails",
    "second_writer",
    "rotation",
]


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    per_rank = launch("checkpoint_faults_worker.py", [{"harm": harm} for harm in HARMS], world_size=2, timeout_s=300)
    by_harm = {}
    for index, harm in enumerate(HARMS):
        ranks = [per_rank[rank][index] for rank in range(2)]
        for rank, result in enumerate(ranks):
            assert result["ok"], (harm, rank, result.get("error"), result.get("trace"))
            assert result["first_save"] == "", (harm, result["first_save"])
        by_harm[harm] = ranks
    return by_harm


def _same_error_on_both(ranks: list[dict], key: str) -> str:
    errors = [r[key][0] for r in ranks]
    assert errors[0] and errors[0] == errors[1], errors
    assert "\n" not in errors[0] and "Traceback" not in errors[0]
    return errors[0]


def _previous_checkpoint_loads(ranks: list[dict]) -> None:
    for result in ranks:
        error, _, loaded = result["load"]
        assert error == "" and loaded == {"step": 1, "exact": True, "finite": True}, result["load"]


@pytest.mark.parametrize("harm", ["pickle", "pickle_old_format"])
def test_a_pickle_payload_never_runs(results, harm):
    """A rank file holding an object with __reduce__ (its meta.json record rewritten to match, or a
    checkpoint without checksums): refused by weights_only loading; the command never runs."""
    ranks = results[harm]
    error = _same_error_on_both(ranks, "load")
    assert "step-000001/rank-00001.pt holds objects other than tensors" in error and "refused" in error
    assert "(it names posix.system)" in error
    assert not ranks[0]["payload_ran"] and not ranks[1]["payload_ran"]
    if harm == "pickle_old_format":
        assert any("no checksums" in w for w in ranks[0]["load"][1])


@pytest.mark.parametrize(
    ("harm", "expected"),
    [
        ("corrupt", "step-000001/rank-00001.pt is corrupt: its sha256 differs"),
        ("truncated", "step-000001/rank-00000.pt is truncated"),
        ("missing", "step-000001/rank-00001.pt is missing"),
        ("garbled_meta", "step-000001/meta.json is not valid JSON"),
        ("meta_step_edited", "step-000001/meta.json was changed after the save (its meta_sha256 does not match"),
        ("meta_fingerprint_edited", "step-000001/meta.json was changed after the save"),
        ("meta_step_text", "step-000001/meta.json: step is 'ten', not a non-negative integer"),
        ("other_model", "was saved for another model: its fingerprint is 0123456789abcdef"),
    ],
)
def test_damage_is_found_and_named_on_every_rank(results, harm, expected):
    error = _same_error_on_both(results[harm], "load")
    assert expected in error, error


def test_a_flipped_byte_in_model_pt_refuses_an_exact_resume_too(results):
    """An exact resume reads the rank files only, so one flipped byte of model.pt went unnoticed (and stayed
    in the checkpoint, to be offered again). Every file is now verified before any loads: both ranks refuse,
    naming model.pt and what to do."""
    error = _same_error_on_both(results["corrupt_model"], "load")
    assert "cannot resume from " in error and "step-000001/model.pt is corrupt: its sha256 differs" in error, error
    assert error.endswith("; restore the file, or start over without --resume (no other checkpoint is beside it)")


def test_a_checkpoint_without_checksums_still_loads_with_a_note(results):
    for rank, result in enumerate(results["old_format"]):
        error, caught, loaded = result["load"]
        assert error == "" and loaded == {"step": 1, "exact": True, "finite": True}
        assert any("no checksums" in w for w in caught) == (rank == 0), caught  # noted once, by rank 0


def test_non_finite_weights_are_not_saved(results):
    ranks = results["nan"]
    error = _same_error_on_both(ranks, "save")
    assert "refusing to save the checkpoint of step 2" in error and "rank 1: the weights of chunk" in error
    assert ranks[0]["disk"] == {"entries": [".lock", "latest", "step-000001"], "latest": "step-000001"}
    _previous_checkpoint_loads(ranks)


def test_not_enough_space_is_refused_before_writing(results):
    ranks = results["no_space"]
    error = _same_error_on_both(ranks, "save")
    assert "not enough space on " in error and "need " in error and "have 4.0 KiB" in error, error
    assert ranks[0]["disk"]["entries"] == [".lock", "latest", "step-000001"]  # no partial directory
    _previous_checkpoint_loads(ranks)


def test_a_failed_write_names_the_rank_and_file_and_leaves_nothing(results):
    ranks = results["write_fails"]
    error = _same_error_on_both(ranks, "save")
    assert "rank 1: could not write " in error and ".step-000002.tmp/rank-00001.pt" in error, error
    # The free space is the failing rank's reading, so both ranks raise the same text (they once each measured it).
    assert re.search(r"rank-00001\.pt: .*\(free on that filesystem: [0-9.]+ [KMGT]?i?B\);", error), error
    assert ranks[0]["disk"]["entries"] == [".lock", "latest", "step-000001"]  # the partial save removed
    _previous_checkpoint_loads(ranks)


def test_a_second_writer_is_refused_and_a_dead_ones_lock_taken_over(results):
    ranks = results["second_writer"]
    error = _same_error_on_both(ranks, "save")
    pid = ranks[0]["holder_pid"]
    assert f"is in use by another job (pid {pid} on host " in error and "started " in error, error
    assert ranks[0]["other_disk"]["entries"] == [".lock"]  # nothing written there
    for result in ranks:
        after_error, caught = result["after_holder_died"]
        assert after_error == ""
    assert any("took over the lock" in w and f"pid {pid}" in w for w in ranks[0]["after_holder_died"][1])


def test_rotation_keeps_the_newest(results):
    ranks = results["rotation"]
    assert ranks[0]["disk"] == {"entries": [".lock", "latest", "step-000002", "step-000003"], "latest": "step-000003"}
    error, _, loaded = ranks[1]["load"]
    assert error == "" and loaded["step"] == 3 and loaded["exact"]
