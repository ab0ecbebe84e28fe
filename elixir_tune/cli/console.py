"""The one place that talks to the terminal: rich consoles and the error/exit conventions.

Exit status: 0 ok, 1 failed (the input was read but is wrong or the job failed), 2 bad usage
(click's own convention, also used for capabilities that are not built yet).
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

from rich.console import Console

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def fail(message: str, hint: str = "", code: int = EXIT_FAILED) -> NoReturn:
    """Prints an error (and what to do about it) to stderr and exits.

    Args:
        message: what was wrong.
        hint: what the user can do about it.
        code: the exit status.
    """
    err_console.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    if hint:
        err_console.print(f"[yellow]hint:[/] {hint}", soft_wrap=True)
    sys.exit(code)


def print_json(data: Any) -> None:
    """Writes machine-readable output to stdout, nothing else on that line."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
