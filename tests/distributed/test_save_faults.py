"""A rank that fails while saving never hangs the others, and nothing good is lost (2 real gloo ranks).

Rank 0 writes for real into a place it cannot write: a file size limit of 4 KiB on rank 0 alone
(``RLIMIT_FSIZE``: the kernel answers EFBIG in the middle of a file, as a full disk answers ENOSPC), or
a target under a regular file (ENOTDIR). Nine cases in one launch: ``save_pretrained`` under a
data-parallel plan (both harms, several files) and a pipeline of 2 stages, ``save_checkpoint``
under both plans, the finetune recipe's ``--save-pretrained`` of a LoRA adapter (and into a folder of the
user's, which it refuses to overwrite), and a user's own
``lora.save_adapter`` (a pipeline of 2 stages) and ``lora.save_merged`` (PEFT and transformers write on
rank 0 alone after the last collective: before, rank 0 failed alone, the others returned as if the save
had worked, and a half-written file replaced the good one). Each saves a good copy first, then fails,
then saves again with the harm gone.

Every rank must raise the same one-line error naming rank 0, the file and the cause, within seconds
(a rank left in a collective would wait for the collective timeout, set to 60 s here: the launch's
limit of 150 s then fails the test instead of blocking CI); the good copy's files must be byte-identical
afterwards, nothing half-written may be left, and the retried save must replace the copy.
"""

from __future__ import annotations

import pytest

from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CASES = [
    dict(save="pretrained", stages=1, harm="not_a_directory"),
    dict(save="pretrained", stages=1, harm="file_too_large", max_shard_size="20KB"),
    dict(save="pretrained", stages=2, harm="file_too_large", max_shard_size="20KB"),
    dict(save="checkpoint", stages=1, harm="file_too_large"),
    dict(save="checkpoint", stages=2, harm="not_a_directory"),
    dict(save="recipe_adapter", stages=1, harm="not_a_directory"),
    dict(save="recipe_adapter", stages=1, harm="user_files"),
    dict(save="adapter", stages=2, harm="file_too_large"),
    dict(save="merged", stages=1, harm="file_too_large"),
]
IDS = [f"{c['save']}-stages{c['stages']}-{c['harm']}" for c in CASES]
BOUND_S = 20.0  # a failed save ends this fast on every rank (measured well under 1 s)


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    with pytest.MonkeyPatch.context() as patch:  # a rank left waiting raises after 60 s instead of 300 s
        patch.setenv("ELIXIR_TUNE_COLLECTIVE_TIMEOUT_S", "60")
        per_rank = launch("save_faults_worker.py", CASES, world_size=2, timeout_s=150)
    return [[per_rank[rank][index] for rank in range(2)] for index in range(len(CASES))]


def _expected_error(case: dict) -> str:
    if case["harm"] == "user_files":  # refused before anything is written
        return (
            "--save-pretrained {base}/theirs: the directory holds files that are not an elixir-tune export "
            "(config.json), which the export would overwrite: give a new or empty directory, or move those files away"
        )
    if case["save"] == "recipe_adapter":  # save_adapter's error, passed on by the recipe
        return "save_adapter: rank 0 could not create {base}/a-file/out: [Errno 20] Not a directory"
    if case["save"] in ("adapter", "merged"):  # PEFT's or transformers' writer, staged on rank 0
        return f"save_{case['save']}: rank 0 could not write {{base}}/out"
    if case["save"] == "pretrained":
        if case["harm"] == "not_a_directory":
            return "save_pretrained: rank 0 could not create {base}/a-file/out: [Errno 20] Not a directory"
        return "save_pretrained: rank 0 could not write {base}/out/model-00001-of-"
    if case["harm"] == "not_a_directory":
        return "rank 0: cannot write checkpoints to {base}/a-file/out: [Errno 20] Not a directory"
    return "rank 0: could not write {base}/out/.step-000002.tmp/rank-00000.pt: [Errno 27] File too large"


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_every_rank_raises_the_same_clear_error_at_once(results, index):
    ranks = results[index]
    for rank, result in enumerate(ranks):
        assert result["ok"], (rank, result.get("error"), result.get("trace"))
    errors = [result["error"] for result in ranks]
    assert errors[0] == errors[1], errors
    error = errors[0]
    kind = "CheckpointError" if CASES[index]["save"] == "checkpoint" else "SaveError"
    assert error.startswith(f"{kind}: "), error
    assert "\n" not in error and "Traceback" not in error
    assert _expected_error(CASES[index]).format(base=ranks[0]["base"]) in error, error
    if CASES[index]["harm"] == "file_too_large" and CASES[index]["save"] == "pretrained":
        assert ".safetensors: [Errno 27] File too large" in error
    if CASES[index]["harm"] == "file_too_large" and CASES[index]["save"] != "checkpoint":
        assert "File too large" in error and error.endswith("was replaced"), error  # and it says so
    assert all(result["save_s"] < BOUND_S for result in ranks), [result["save_s"] for result in ranks]
    assert all(result["in_step"] for result in ranks)


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_the_previous_copy_is_untouched_and_nothing_half_written_is_left(results, index):
    written = results[index][0]
    assert written["before"] and written["after"] == written["before"]  # byte-identical, file for file
    assert written["leftovers"] == []
    if CASES[index]["save"] == "pretrained" and CASES[index].get("max_shard_size"):
        assert "model.safetensors.index.json" in written["before"]  # several files and their index


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_the_save_succeeds_once_the_cause_is_gone(results, index):
    written = results[index][0]
    assert written["retry_leftovers"] == []
    if CASES[index]["save"] != "checkpoint":  # the same names, new weights (one more step trained)
        assert written["retried"].keys() == written["before"].keys()
        changed = [name for name in written["before"] if written["retried"][name] != written["before"][name]]
        assert any(name.endswith(".safetensors") for name in changed), changed
    else:  # a new step directory beside the first one, latest pointing at it
        assert "step-000003/meta.json" in written["retried"] and "step-000001/meta.json" in written["retried"]


def test_the_recipe_export_leaves_a_users_folder_as_it_was(results):
    """--save-pretrained into a folder of the user's wrote config.json and the rest over their files without a
    word; now every rank refuses (the error above) and the folder is as it was. An earlier export of the recipe
    (its marker there) is still replaced: the retried save above."""
    written = results[CASES.index(dict(save="recipe_adapter", stages=1, harm="user_files"))][0]
    assert written["theirs"] == {"config.json": '{"mine": true}\n'}  # nothing replaced, nothing added
