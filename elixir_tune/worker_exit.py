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

Under elixir-run a worker that ends itself with a nonzero status (``exit_worker(1)``, ``sys.exit(1)``)
chose it, having said why: ``note_chosen_exit`` writes ``rank<R>.exit`` into ``$ELIXIR_TUNE_RUN_DIR``,
and elixir-run then leaves out torchrun's own report of that exit ("failed (exitcode: 1)"), which
says nothing the worker and elixir-run's summary do not (launcher/launch.py).
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
    if code:
        note_chosen_exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the script
            pass
    os._exit(code or 0)


def note_chosen_exit(code: int | str) -> bool:
    """Tells elixir-run that this worker ends itself with a nonzero status (module docstring).

    Args:
        code: the status (a ``sys.exit`` message counts as 1).

    Returns:
        Whether it was written (not under elixir-run, or the run directory gone: no).
    """
    from elixir_tune.launcher.env import RUN_DIR_ENV  # imports no torch

    run_dir = os.environ.get(RUN_DIR_ENV, "")
    if not run_dir:
        return False
    try:
        with open(os.path.join(run_dir, f"rank{os.environ.get('RANK', '0')}.exit"), "w") as file:
            file.write(str(code if isinstance(code, int) else 1))
    except OSError:
        return False  # a courtesy to elixir-run's report: the worker's end must not fail for it
    return True
