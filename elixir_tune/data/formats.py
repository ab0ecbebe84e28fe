"""What a data file is: reading it through ``datasets`` (local files only), and its format from its fields.

``inspect_data`` is the cheap preflight the CLI runs before any worker starts: the file exists and
parses, the format is detected from the fields (or the given one fits them), and every record has
the fields the format needs with the right types. No tokenizer and no torch here; every problem is
a one-line ``DataError`` saying what is wrong and what to do.

Formats, by the fields of the records:

    text               a ``text`` string (and plain .txt files)
    prompt_completion  ``prompt`` and ``completion`` strings: the loss is on the completion only
    messages           ``messages``: a list of {role, content}, rendered by the tokenizer's chat
                       template: the loss is on the assistant turns only
"""

from __future__ import annotations

import codecs
import contextlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets  # type: ignore[import-untyped]

FORMATS = ("text", "prompt_completion", "messages")
FORMAT_FIELDS = {"text": ("text",), "prompt_completion": ("prompt", "completion"), "messages": ("messages",)}
TEXT_MODES = ("pack", "document", "line", "paragraph")
TEXT_SUFFIXES = (".txt", ".text", ".md")
# suffix -> the ``datasets`` builder that reads it
TABLE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_UTF8_BLOCK_BYTES = 1 << 20  # how much of a data file the UTF-8 check reads at a time


class DataError(ValueError):
    """A data file or data option is wrong: the message is one line saying what and what to do."""


@dataclass
class DataSpec:
    """Which data to train on and how to cut it into samples.

    Attributes:
        path: a file (.txt, .json, .jsonl, .parquet, .csv) or a ``datasets.save_to_disk`` directory.
        format: ``auto`` (detected from the fields), ``text``, ``prompt_completion`` or ``messages``.
        text_mode: for text: ``pack`` (the documents joined with EOS and cut into full seq_len
            windows), ``document`` (one sample per document: a .txt file, or a record),
            ``line`` or ``paragraph`` (one sample per line / blank-line separated paragraph).
        packing: pack several prompt/completion, messages or text samples into one seq_len row,
            each attending only to itself (position_ids restart at 0 for each).
        eval_fraction: the share of the samples held out for evaluation (chosen by ``seed``).
        eval_path: a separate evaluation file instead, read by the same rules.
        seed: the seed of the epoch permutations and of the held-out share.
    """

    path: str
    format: str = "auto"
    text_mode: str = "pack"
    packing: bool = False
    eval_fraction: float = 0.0
    eval_path: str | None = None
    seed: int = 0


@dataclass
class DataInfo:
    """What ``inspect_data`` found: the detected format, the fields and the number of records."""

    path: str
    format: str
    fields: list[str]
    num_records: int
    text_mode: str = "pack"
    eval: DataInfo | None = field(default=None, repr=False)

    def describe(self) -> str:
        """One line: file, format (and how it was recognized), records."""
        source = "plain text" if not self.fields else "fields " + ", ".join(self.fields)
        mode = f", text mode {self.text_mode}" if self.format == "text" else ""
        line = f"{self.path}: {self.format} ({source}{mode}), {self.num_records:,} records"
        if self.eval is not None:
            line += f"; eval {self.eval.path}: {self.eval.num_records:,} records"
        return line


def check_spec(spec: DataSpec) -> None:
    """The options alone make sense (no file read).

    Raises:
        DataError: an unknown format or text mode, or an eval_fraction outside [0, 1).
    """
    if spec.format not in ("auto", *FORMATS):
        raise DataError(f"data format {spec.format!r} is not one of auto, {', '.join(FORMATS)}")
    if spec.text_mode not in TEXT_MODES:
        raise DataError(f"text mode {spec.text_mode!r} is not one of {', '.join(TEXT_MODES)}")
    if not 0.0 <= spec.eval_fraction < 1.0:
        raise DataError(f"eval fraction {spec.eval_fraction} is outside [0, 1): give the held-out share, e.g. 0.05")
    if spec.eval_fraction > 0 and spec.eval_path is not None:
        raise DataError("give an eval fraction or an eval file, not both")


def inspect_data(spec: DataSpec) -> DataInfo:
    """Check that the data (and the eval file, if any) can be read and fits a format.

    Args:
        spec: the data to check.

    Returns:
        The format, fields and number of records; ``eval`` holds the eval file's, if any.

    Raises:
        DataError: a missing or unreadable file, a parse error, fields that fit no format or
            several, records that lack a field or hold the wrong type, bad options.
    """
    check_spec(spec)
    info, _ = read_data(spec.path, spec.format, spec.text_mode)
    if spec.eval_path is not None:
        info.eval, _ = read_data(spec.eval_path, info.format, spec.text_mode)
    return info


def read_data(path: str, format: str, text_mode: str) -> tuple[DataInfo, datasets.Dataset]:
    """Read a data file or saved dataset, detect or check its format, and check its records.

    Args:
        path: the file or ``save_to_disk`` directory.
        format: ``auto`` or the format the records must fit.
        text_mode: recorded in the returned info (text only).

    Returns:
        The info and the records as a ``datasets.Dataset`` (in memory).

    Raises:
        DataError: as ``inspect_data``.
    """
    if _is_plain_text(Path(path)) and format not in ("auto", "text"):
        raise DataError(
            f"{path} is plain text, not format {format}: give a JSON, JSONL, Parquet or CSV file of records"
        )
    dataset = read_records(Path(path))
    fields = [] if _is_plain_text(Path(path)) else list(dataset.column_names)
    detected = "text" if not fields else detect_format(path, fields, format)
    check_records(path, dataset, detected)
    return DataInfo(str(path), detected, fields, len(dataset), text_mode), dataset


def detect_format(path: str, fields: list[str], format: str = "auto") -> str:
    """The format that the fields fit: the given one if it fits, else the one detected.

    Raises:
        DataError: the fields fit no format, or several (``auto``), or not the given one.
    """
    shown = sorted(fields)
    if format != "auto":
        missing = [name for name in FORMAT_FIELDS[format] if name not in fields]
        if missing:
            raise DataError(
                f"{path}: format {format} needs the fields {', '.join(FORMAT_FIELDS[format])}; found {shown}"
            )
        return format
    fitting = [name for name, needed in FORMAT_FIELDS.items() if all(f in fields for f in needed)]
    described = "; ".join("+".join(needed) for needed in FORMAT_FIELDS.values())
    if not fitting:
        raise DataError(f"{path}: fields {shown} fit no format ({described}): rename the fields or convert the data")
    if len(fitting) > 1:
        raise DataError(
            f"{path}: fields {shown} fit several formats ({', '.join(fitting)}): the records mix formats; "
            "keep one format per file or give the format explicitly"
        )
    return fitting[0]


def check_records(path: str, dataset: datasets.Dataset, format: str) -> None:
    """Every record has the format's fields, with the right types (checked on the Arrow schema).

    Raises:
        DataError: naming the field and the first record that lacks it.
    """
    import pyarrow as pa  # type: ignore[import-untyped]

    table = dataset.data.table if hasattr(dataset.data, "table") else dataset.data
    for name in FORMAT_FIELDS[format]:
        column = table.column(name)
        kind = column.type
        if format == "messages":
            ok = (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and _is_message_struct(kind.value_type)
            expected = "a list of {role, content} strings"
        else:
            ok = pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
            expected = "a string"
        if not ok:
            raise DataError(f"{path}: field {name!r} holds {kind}, format {format} needs {expected} in every record")
        if format == "messages" and ok:
            _check_assistant_turns(path, column)
        if column.null_count:
            first = next(i for i, value in enumerate(column.is_null().to_pylist()) if value)
            raise DataError(
                f"{path}: record {first} has no {name!r} ({column.null_count} records lack it or leave it empty): "
                f"every record needs the fields of format {format}"
            )


def _check_assistant_turns(path: str, column: Any) -> None:
    """Every conversation has an assistant turn: without one a record has nothing to learn from."""
    import pyarrow as pa
    import pyarrow.compute as pc  # type: ignore[import-untyped]

    messages = pa.concat_arrays(column.chunks) if column.num_chunks != 1 else column.chunk(0)
    roles = pc.struct_field(pc.list_flatten(messages), "role")
    owners = pc.list_parent_indices(messages)
    with_assistant = set(pc.filter(owners, pc.equal(roles, "assistant")).to_pylist())
    lacking = [record for record in range(len(messages)) if record not in with_assistant and messages[record].is_valid]
    if lacking:
        raise DataError(
            f"{path}: record {lacking[0]} has no assistant turn ({len(lacking)} records have none), so nothing to "
            "learn from it: remove those records"
        )


def _is_message_struct(kind: Any) -> bool:
    import pyarrow as pa

    if not pa.types.is_struct(kind):
        return False
    names = {kind.field(i).name: kind.field(i).type for i in range(kind.num_fields)}
    return all(
        n in names and (pa.types.is_string(names[n]) or pa.types.is_large_string(names[n])) for n in ("role", "content")
    )


def _is_plain_text(path: Path) -> bool:
    return path.suffix.lower() in TEXT_SUFFIXES


def read_records(path: Path) -> datasets.Dataset:
    """The records of a local file or saved dataset, through ``datasets`` (never the hub).

    A .txt/.text/.md file is one record with a ``text`` field (the whole file); a .json or .jsonl
    file is always read as JSON records, never as text.

    Raises:
        DataError: the path does not exist, has an unknown suffix, or does not parse.
    """
    if not path.exists():
        raise DataError(f"data file {path} does not exist: check the path")
    import datasets

    suffix = path.suffix.lower()
    builder = ""
    with _quiet_datasets(), tempfile.TemporaryDirectory(prefix="elixir-data-") as cache_dir:
        try:
            if path.is_dir():
                return _load_saved(path, datasets)
            if suffix in TEXT_SUFFIXES:
                builder, options = "text", {"sample_by": "document"}
            elif suffix in TABLE_BUILDERS:
                builder, options = TABLE_BUILDERS[suffix], {}
            else:
                kinds = ", ".join((*TEXT_SUFFIXES, *TABLE_BUILDERS))
                raise DataError(f"data file {path}: unknown suffix {suffix!r}; give one of {kinds} or a saved dataset")
            if path.stat().st_size == 0:
                raise DataError(f"data file {path} is empty")
            if builder != "parquet":
                _refuse_non_utf8(path)
            dataset = datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=cache_dir, keep_in_memory=True, **options
            )
        except DataError:
            raise
        except Exception as error:  # datasets wraps pyarrow's and pandas' parse errors in its own
            where = _json_error(path) if builder == "json" else None
            raise DataError(
                f"data file {path} does not parse as {suffix.lstrip('.') or 'data'}: {where or _root_cause(error)}"
            ) from None
    if builder == "json" and _is_one_object(path):  # datasets reads it as one row: a file that trains on one sample
        raise DataError(
            f"data file {path} holds one JSON object, not rows of records: give a JSON list of records "
            '([{"text": ...}, {"text": ...}]) or JSON Lines (.jsonl, one record per line)'
        )
    if len(dataset) == 0:
        raise DataError(f"data file {path} has no records")
    return dataset


def _is_one_object(path: Path) -> bool:
    """Whether a JSON file that ``datasets`` parsed is a single object rather than rows: an object spread over
    several lines (JSON lines hold one record per line), or a .json file whose only line is an object (in a
    .jsonl file that line is one record, as JSON lines mean it). Reads the first lines only."""
    import json

    with open(path, encoding="utf-8", errors="replace") as file:
        lines = (line for line in file if line.strip())
        first = next(lines, "")
        if not first.lstrip().startswith("{"):
            return False  # a list of records
        try:
            json.loads(first)
        except json.JSONDecodeError:
            return True  # the object goes on over the next lines: the whole file is one document
        return path.suffix.lower() == ".json" and next(lines, None) is None


def _load_saved(path: Path, datasets: Any) -> datasets.Dataset:
    if not (path / "dataset_info.json").is_file() and not (path / "dataset_dict.json").is_file():
        raise DataError(f"data directory {path} is not a saved dataset (datasets.save_to_disk): give a file or one")
    loaded = datasets.load_from_disk(str(path), keep_in_memory=True)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"saved dataset {path} has splits {sorted(loaded)} but no 'train': save one split")
        loaded = loaded["train"]
    return loaded


def _json_error(path: Path) -> str | None:
    """Where a JSON or JSON-lines file stops parsing, as the standard parser says (line and column).

    A .json file is tried as one document first; a file whose first line is a whole JSON value is
    read as JSON lines, one value per line.
    """
    import json

    text = path.read_text(errors="replace")
    lines = text.splitlines()
    if path.suffix.lower() == ".json":
        try:
            json.loads(text)
            return None
        except json.JSONDecodeError as error:
            whole = f"line {error.lineno}: {error.msg} (column {error.colno})"
        try:
            json.loads(lines[0] if lines else "")
        except json.JSONDecodeError:
            return whole
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as error:
                return f"line {number}: {error.msg} (column {error.colno})"
    return None


def _refuse_non_utf8(path: Path) -> None:
    """Refuses a text, JSON or CSV file holding a byte that is not UTF-8, naming its line and byte offset.

    pyarrow's JSON reader keeps such a byte inside a string without a word: the preflight passed and every
    worker then failed in its tokenizer with a traceback. Read in blocks: a data file may be gigabytes.

    Raises:
        DataError: the first such byte, or a character cut off at the end of the file.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    fed = newlines = 0  # bytes and line ends before the block being decoded
    with open(path, "rb") as file:
        while True:
            block = file.read(_UTF8_BLOCK_BYTES)
            pending = len(decoder.getstate()[0])  # the start of a character cut by the last block's end
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:  # error.object is pending + block
                offset = fed - pending + error.start
                line = newlines + error.object[pending : error.start].count(b"\n") + 1
                raise DataError(
                    f"data file {path} is not UTF-8: line {line} (byte offset {offset}) holds byte "
                    f"0x{error.object[error.start]:02x}; save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            if not block:
                return
            fed += len(block)
            newlines += block.count(b"\n")


def _root_cause(error: BaseException) -> str:
    """The innermost cause's message, on one line (datasets wraps the parser's error)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    message = " ".join(str(error).split()) or type(error).__name__
    return message if len(message) <= 200 else message[:197] + "..."


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars or info logs from ``datasets`` while it reads (they are not the user's output)."""
    import datasets

    was_disabled = datasets.utils.logging.is_progress_bar_enabled() is False
    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # parse errors become DataErrors
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not was_disabled:
            datasets.enable_progress_bars()
