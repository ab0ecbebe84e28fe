"""elixir_tune.data: what a data file is (format detection) and the one-line errors for bad data."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elixir_tune.data import DataError, DataSpec, inspect_data, load_data
from tests.fixtures.tiny_hf import CHAT_TEMPLATE, train_tokenizer, write_formats


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_formats(tmp_path_factory.mktemp("formats"))


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


EXPECTED = {
    "txt": ("text", []),
    "text_jsonl": ("text", ["text", "source"]),
    "prompt_completion_jsonl": ("prompt_completion", ["prompt", "completion"]),
    "messages_jsonl": ("messages", ["messages"]),
    "text_parquet": ("text", ["text"]),
    "prompt_completion_csv": ("prompt_completion", ["prompt", "completion"]),
    "messages_dataset": ("messages", ["messages"]),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_format_is_detected_from_its_fields(files, name):
    info = inspect_data(DataSpec(str(files[name])))
    assert (info.format, info.fields) == EXPECTED[name]
    assert info.num_records == {"txt": 1, "prompt_completion_jsonl": 6, "prompt_completion_csv": 6}.get(
        name, 4 if "messages" in name else 12
    )
    assert info.format in info.describe() and str(files[name]) in info.describe()


def test_describe_says_how_the_format_was_found(files, tokenizer):
    data = load_data(DataSpec(str(files["prompt_completion_jsonl"])), tokenizer, 64)
    assert "prompt_completion (detected from fields prompt, completion)" in data.describe()
    data = load_data(DataSpec(str(files["txt"]), text_mode="line"), tokenizer, 64)
    assert "text (plain text file, text mode line)" in data.describe()


def test_a_jsonl_file_is_never_read_as_plain_text(files, tokenizer, tmp_path):
    data = load_data(DataSpec(str(files["text_jsonl"]), text_mode="document"), tokenizer, 512)
    decoded = tokenizer.decode(data.batch(0, data.num_samples(), 0, 1)["input_ids"].flatten())
    assert '{"text"' not in decoded and '"source"' not in decoded
    lines = tmp_path / "lines.jsonl"
    lines.write_text("just some words\nanother line\n")
    with pytest.raises(DataError, match=r"lines.jsonl does not parse as jsonl: line 1: Expecting value"):
        inspect_data(DataSpec(str(lines)))


def one_line_error(spec, *args) -> str:
    with pytest.raises(DataError) as caught:
        inspect_data(spec) if not args else load_data(spec, *args)
    message = str(caught.value)
    assert "\n" not in message and caught.value.__cause__ is None
    return message


def test_bad_files_give_one_line_errors(tmp_path):
    assert "does not exist" in one_line_error(DataSpec(str(tmp_path / "missing.jsonl")))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": \n')
    assert "broken.jsonl does not parse as jsonl: line 2" in one_line_error(DataSpec(str(broken)))
    broken_json = tmp_path / "broken.json"
    broken_json.write_text('[{"text": "a"},\n {"text": }]')
    assert "broken.json does not parse as json: line 2" in one_line_error(DataSpec(str(broken_json)))
    broken_csv = tmp_path / "broken.csv"
    broken_csv.write_text('prompt,completion\n"a,b\n')
    assert "broken.csv does not parse as csv" in one_line_error(DataSpec(str(broken_csv)))
    unknown = tmp_path / "data.xml"
    unknown.write_text("<a/>")
    assert "unknown suffix '.xml'" in one_line_error(DataSpec(str(unknown)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "is empty" in one_line_error(DataSpec(str(empty)))
    (tmp_path / "plain_dir").mkdir()
    assert "not a saved dataset" in one_line_error(DataSpec(str(tmp_path / "plain_dir")))


def test_a_saved_dataset_dict_gives_its_train_split(tmp_path):
    import datasets

    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"text": "a"}, {"text": "b"}]),
            "test": datasets.Dataset.from_list([{"text": "c"}]),
        }
    )
    splits.save_to_disk(str(tmp_path / "with_train"))
    assert inspect_data(DataSpec(str(tmp_path / "with_train"))).num_records == 2
    datasets.DatasetDict({"test": splits["test"]}).save_to_disk(str(tmp_path / "no_train"))
    assert "splits ['test'] but no 'train'" in one_line_error(DataSpec(str(tmp_path / "no_train")))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def test_fields_that_fit_no_format_or_several_are_named(tmp_path):
    unknown = write_jsonl(tmp_path / "unknown.jsonl", [{"foo": "a", "bar": 1}])
    message = one_line_error(DataSpec(unknown))
    assert "fields ['bar', 'foo'] fit no format (text; prompt+completion; messages)" in message
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "a"}, {"prompt": "q", "completion": "a"}])
    message = one_line_error(DataSpec(mixed))
    assert "fields ['completion', 'prompt', 'text'] fit several formats (text, prompt_completion)" in message
    # the format given: the records lacking its fields are named
    assert "record 1 has no 'text'" in one_line_error(DataSpec(mixed, format="text"))
    assert "format messages needs the fields messages; found ['completion', 'prompt', 'text']" in one_line_error(
        DataSpec(mixed, format="messages")
    )


def test_records_of_the_wrong_shape_are_named(tmp_path, tokenizer):
    numbers = write_jsonl(tmp_path / "numbers.jsonl", [{"prompt": 1, "completion": "a"}])
    assert "field 'prompt' holds int64, format prompt_completion needs a string" in one_line_error(DataSpec(numbers))
    wrong_keys = write_jsonl(tmp_path / "keys.jsonl", [{"messages": [{"role": "user", "text": "hi"}]}])
    assert "needs a list of {role, content} strings" in one_line_error(DataSpec(wrong_keys))
    silent = write_jsonl(tmp_path / "silent.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    assert "record 0 has no assistant turn (1 records have none)" in one_line_error(DataSpec(silent))


def test_options_and_tokenizers_that_do_not_fit(files, tokenizer):
    assert "is plain text, not format messages" in one_line_error(DataSpec(str(files["txt"]), format="messages"))
    assert "format 'chat'" in one_line_error(DataSpec(str(files["txt"]), format="chat"))
    assert "text mode 'lines'" in one_line_error(DataSpec(str(files["txt"]), text_mode="lines"))
    assert "outside [0, 1)" in one_line_error(DataSpec(str(files["txt"]), eval_fraction=1.0))
    pairs = DataSpec(str(files["prompt_completion_jsonl"]))
    assert "format prompt_completion needs the model's tokenizer" in one_line_error(pairs, None, 64)
    bare = train_tokenizer()
    bare.chat_template = None
    assert "has no chat template" in one_line_error(DataSpec(str(files["messages_jsonl"])), bare, 64)
    assert "leaves none to train on" in one_line_error(
        DataSpec(str(files["txt"]), text_mode="document", eval_fraction=0.5), tokenizer, 512
    )


def test_a_template_that_is_not_prefix_stable_asks_for_generation_markers(files):
    # no {% generation %}, and each rendering ends with the number of messages: prefixes do not line up
    odd = train_tokenizer()
    odd.chat_template = (
        CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "") + "{{ messages | length }}"
    )
    data = load_data(DataSpec(str(files["messages_jsonl"])), odd, 64)
    with pytest.raises(DataError, match=r"record \d+: .* mark them with \{% generation %\}"):
        data.batch(0, 1, 0, 1)


def test_importing_the_package_loads_no_torch_datasets_or_transformers():
    code = "import sys, elixir_tune.data; print(sorted({'torch', 'datasets', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_a_json_file_of_one_object_is_refused_and_lists_and_lines_are_read(tmp_path):
    """datasets reads a .json file holding one object as one row: a run trained on that one sample (or a dict
    of columns as one row of lists). One object is refused; a list of records and JSON lines are rows."""
    refused = 'holds one JSON object, not rows of records: give a JSON list of records ([{"text": ...}, {"text": ...}])'
    for name, content in (
        ("one.json", '{"text": "a whole corpus in one record"}'),
        ("pretty.json", '{\n  "text": "a",\n  "source": "b"\n}\n'),
        ("columns.json", '{"text": ["a", "b"]}'),
        ("pretty.jsonl", '{\n  "text": "a"\n}\n'),  # JSON lines hold one record per line
    ):
        (tmp_path / name).write_text(content)
        message = one_line_error(DataSpec(str(tmp_path / name)))
        assert message == f"data file {tmp_path / name} {refused} or JSON Lines (.jsonl, one record per line)"
    (tmp_path / "rows.json").write_text('[{"text": "a"}, {"text": "b"}]')
    (tmp_path / "lines.json").write_text('{"text": "a"}\n{"text": "b"}\n')
    (tmp_path / "one.jsonl").write_text('{"text": "a"}\n')  # one record, as JSON lines mean it
    counts = {
        n: inspect_data(DataSpec(str(tmp_path / n))).num_records for n in ("rows.json", "lines.json", "one.jsonl")
    }
    assert counts == {"rows.json": 2, "lines.json": 2, "one.jsonl": 1}
