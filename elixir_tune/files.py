"""The one way elixir-tune reads its input files (plans, profiles, hardware specs, JSON metadata).

Whatever is wrong with a file (missing, a directory, unreadable, binary, not UTF-8, not YAML or
JSON, the wrong kind of document) becomes an ``InputFileError`` whose message is one line that
names the file and says what is wrong, never a bare ``UnicodeDecodeError`` or parser traceback.
Schema checks stay with each kind of file; they raise ``InputFileError`` through ``problem`` too.
No torch here: the CLI and ``plan/`` use it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

# A plan, profile or hardware file is a few hundred kilobytes at most; a bigger one is not one of ours.
MAX_INPUT_BYTES = 64 * 1024 * 1024

_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# Values a document may hold with its aliases expanded. A YAML alias bomb (anchors nested nine deep,
# nine aliases each) is small on disk and as parsed (aliases are shared references), but any walk
# of it, a validation or a fingerprint, would visit billions of values. OPT-175B's profile holds 28,307.
MAX_EXPANDED_VALUES = 1_000_000


class InputFileError(ValueError):
    """An input file that cannot be used.

    Attributes:
        path: the file, as the user named it.
        problem: what is wrong, one line without the file name.
        hint: what to do about it (may be empty).
    """

    def __init__(self, path: str | os.PathLike, problem: str, hint: str = ""):
        self.path = str(path)
        self.problem = problem
        self.hint = hint
        super().__init__(f"{self.path}: {problem}" + (f" ({hint})" if hint else ""))


def read_text(path: str | os.PathLike, kind: str, hint: str = "") -> str:
    """Reads a UTF-8 text file.

    Args:
        path: the file.
        kind: what the file should be, for messages (``plan``, ``profile``, ``hardware spec``).
        hint: what to do when the file is missing or unusable.

    Returns:
        The text.

    Raises:
        InputFileError: missing, a directory, unreadable, too large, binary or not UTF-8.
    """
    path = Path(path)
    if not path.exists():
        raise InputFileError(path, f"no such {kind} file", hint)
    if path.is_dir():
        raise InputFileError(path, f"is a directory, not a {kind} file", hint)
    try:
        size = path.stat().st_size
        if size > MAX_INPUT_BYTES:
            raise InputFileError(path, f"{size:,} bytes is far too large for a {kind} file", hint)
        data = path.read_bytes()
    except OSError as error:
        raise InputFileError(path, f"cannot be read: {error.strerror or error}", hint) from None
    if b"\0" in data:
        raise InputFileError(path, f"is a binary file, not a {kind} (YAML text)", hint)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputFileError(
            path, f"is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); not a {kind}", hint
        ) from None


def load_yaml(path: str | os.PathLike, kind: str, hint: str = "") -> Any:
    """Reads a YAML file into plain Python objects (safe loader: no tags that build objects).

    Args:
        path: the file.
        kind: what the file should be, for messages.
        hint: what to do when the file is unusable.

    Returns:
        The parsed document.

    Raises:
        InputFileError: as ``read_text``, or the text is not YAML (line and column named).
    """
    text = read_text(path, kind, hint)
    try:
        document = yaml.load(text, Loader=_YAML_LOADER)
        if "&" in text and expanded_values(document, MAX_EXPANDED_VALUES) > MAX_EXPANDED_VALUES:
            raise InputFileError(
                path,
                f"its aliases expand to more than {MAX_EXPANDED_VALUES:,} values (a YAML alias bomb?); not a {kind}",
                hint,
            )
        return document
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise InputFileError(path, f"YAML syntax error at {where}: {error.problem}", hint) from None
    except (yaml.YAMLError, RecursionError) as error:
        raise InputFileError(
            path, f"not valid YAML: {str(error).splitlines()[0] if str(error) else error!r}", hint
        ) from None


def expanded_values(document: Any, limit: int) -> int:
    """How many values ``document`` holds with shared references counted each time (stops past ``limit``)."""
    count, stack = 0, [document]
    while stack and count <= limit:
        value = stack.pop()
        count += 1
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return count


def load_yaml_mapping(path: str | os.PathLike, kind: str, hint: str = "") -> dict:
    """``load_yaml`` for documents that must be a mapping (every input file of elixir-tune is one).

    Raises:
        InputFileError: as ``load_yaml``, or the document is empty or not a mapping (a truncated
            or wrong file).
    """
    raw = load_yaml(path, kind, hint)
    if raw is None:
        raise InputFileError(path, f"is empty, not a {kind}", hint)
    if not isinstance(raw, dict):
        raise InputFileError(path, f"holds a YAML {type(raw).__name__}, not a {kind} (a mapping of fields)", hint)
    return raw


def load_json(path: str | os.PathLike, kind: str, hint: str = "") -> Any:
    """Reads a JSON file (checkpoint metadata and the like).

    Raises:
        InputFileError: as ``read_text``, or the text is not JSON (line and column named).
    """
    text = read_text(path, kind, hint)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InputFileError(
            path, f"not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}", hint
        ) from None
    except RecursionError:
        raise InputFileError(path, "not usable JSON: nested too deeply", hint) from None


def problem(path: str | os.PathLike, problems: list[str], kind: str, hint: str = "") -> InputFileError:
    """One error, on one line, for a file whose content fails its schema: every problem, ``; ``-separated.

    Args:
        path: the file.
        problems: every problem found, each with its field path.
        kind: what the file should be.
        hint: what to do.
    """
    count = f"{len(problems)} problem(s): " if len(problems) > 1 else ""
    return InputFileError(path, f"not a valid {kind}: {count}" + "; ".join(problems), hint)
