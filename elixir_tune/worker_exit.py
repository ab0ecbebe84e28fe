"""How a worker process that used torch.distributed ends: without the interpreter's C++ teardown.

A worker whose work is done (results written, process group destroyed) was seen to abort in the
interpreter's final teardown ("terminate called without an active exception", SIGABRT, no Python
frame): a gloo thread still held async work whose tensors it released after Python had begun to shut
down. (The tests' forked workers end the same way for another reason: a forked child's teardown
copies the heap it shares with its zygote, tests/distributed/worker_zygote.py.) The parent then saw
status -6 after a good run: elixir-run reported a failed job, and `elixir-tune probe` failed with
"probe worker (cpu) 1 of 2 exited with status -6" after its collectives. ``exit_worker`` runs everything a normal exit does for us (non-daemon threads joined,
atexit handlers, output flushed) and skips only that teardown. Used by the recipes' workers and the
probe's. Imports no torch.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def exit_worker(code: int | None) -> None:
    """Ends this process with ``code`` without the interpreter's final teardown (module docstring).

    Args:
        code: the exit status (a ``main()``'s return value; None is 0, as for ``sys.exit``).
    """
    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter calls at exit to join threads
    if shutdown is not None:
        shutdown()
    # An engine's exit settles only after a normal end (engine/comm/control.py), which the atexit
    # handler alone cannot tell from a nonzero status.
    control = sys.modules.get("elixir_tune.engine.comm.control")
    if control is not None:
        control.script_ended(not code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the script
            pass
    os._exit(code or 0)
