"""What a recipe's checkpoint records of its data, and which changes a resume sees (recipes/data_identity.py)."""

from __future__ import annotations

import argparse
import os

from elixir_tune.recipes.data_identity import data_change, data_record


def _args(data, synthetic: bool = False) -> argparse.Namespace:
    return argparse.Namespace(data=str(data), synthetic=synthetic)


def test_a_synthetic_run_records_synthetic_and_a_file_its_path_and_size(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("abc")
    assert data_record(_args(text, synthetic=True)) == {"data": "synthetic", "data_bytes": None}
    assert data_record(_args(text)) == {"data": str(text), "data_bytes": 3}
    (tmp_path / "saved").mkdir()  # a datasets.save_to_disk directory: its files together
    (tmp_path / "saved" / "part.arrow").write_bytes(b"12345")
    assert data_record(_args(tmp_path / "saved"))["data_bytes"] == 5


def test_a_resume_sees_other_data_a_changed_file_and_not_the_same(tmp_path):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("abc")
    second.write_text("abc")
    saved = data_record(_args(first))
    assert data_change(saved, _args(first)) is None
    assert data_change(saved, _args(second)) == (
        f"the checkpoint was saved training on --data {first}, this run trains on --data {second}"
    )
    assert data_change(saved, _args(first, synthetic=True)) == (
        f"the checkpoint was saved training on --data {first}, this run trains on random tokens (--synthetic)"
    )
    first.write_text("abcdef")
    assert data_change(saved, _args(first)) == f"{first} changed since the checkpoint was saved (3 bytes then, 6 now)"
    assert data_change({}, _args(second)) is None  # a checkpoint from before the data was recorded


def test_an_older_checkpoints_relative_path_is_read_from_where_the_run_starts(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    previous = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert data_change({"data": "a.txt"}, _args(tmp_path / "a.txt")) is None
    finally:
        os.chdir(previous)
