"""The one place that talks to the terminal: rich consoles and the error/exit conventions.

The other cli modules take what they need of rich (Table, Progress, escape) from here, so that
rich is imported in this file alone.

Exit status: 0 ok, 1 failed (the input was read but is wrong or the job failed), 2 bad usage
(click's own convention, also used for capabilities that are not built yet).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console, RenderableType
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
WIDE_COLUMNS = 140  # into a pipe or a file (no terminal width to respect) tables print this wide


def fail(message: str, hint: str = "", code: int = EXIT_FAILED) -> NoReturn:
    """Prints an error (and what to do about it) to stderr and exits.

    Args:
        message: what was wrong.
        hint: what the user can do about it.
        code: the exit status.
    """
    # The message and hint are plain text (paths, usage strings with [OPTIONS]), never markup.
    err_console.print(Text.assemble(("error: ", "bold red"), message), soft_wrap=True)
    if hint:
        err_console.print(Text.assemble(("hint: ", "yellow"), hint), soft_wrap=True)
    sys.exit(code)


def refuse_output_over_input(out: str, inputs: dict[str, str | None]) -> None:
    """Exits (usage) when ``out`` names the same file as one of the command's inputs, which writing it
    would replace without a word.

    Args:
        out: the output path.
        inputs: option name -> the input path it was given (None: not given).
    """
    target = Path(out).resolve()
    for option, path in inputs.items():
        if path and Path(path).is_file() and Path(path).resolve() == target:
            fail(
                f"--out {out} is the file given as {option}; writing it would replace that input",
                "name another output file with --out",
                code=EXIT_USAGE,
            )


def print_wide(renderable: RenderableType, width: int = WIDE_COLUMNS) -> None:
    """Prints at the terminal's width, or ``width`` columns when stdout is not a terminal (a pipe,
    a log), so that wide tables are not squeezed to 80 columns."""
    if console.is_terminal:
        console.print(renderable)
    else:
        Console(width=width, highlight=False).print(renderable)


def print_json(data: Any) -> None:
    """Writes machine-readable output to stdout, nothing else on that line."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


__all__ = [
    "Progress",
    "SpinnerColumn",
    "Table",
    "TextColumn",
    "TimeElapsedColumn",
    "console",
    "err_console",
    "escape",
    "fail",
    "print_json",
    "print_wide",
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
]
