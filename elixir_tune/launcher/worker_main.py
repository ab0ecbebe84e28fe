"""The first code of every worker elixir-run starts: ties the worker's life to elixir-run, then runs
the user's script as ``python script.py`` would.

    python -m elixir_tune.launcher.worker_main SCRIPT [SCRIPT_ARGS...]
    python -m elixir_tune.launcher.worker_main -m MODULE [ARGS...]

elixir-run runs torchrun's agent in its own process, so the workers are its children. Before the
script runs, each worker asks Linux to SIGKILL it when that parent dies (``PR_SET_PDEATHSIG``):
a ``kill -9`` of elixir-run, which no handler can see, then ends every worker at once instead of
leaving them training and saving without a launcher. Where prctl does not exist, a thread polls
the parent instead. On a CPU plan (``$ELIXIR_TUNE_CPU_BIND`` = 1, exported by elixir-run) the worker
then binds itself to its share of the node's cores (``elixir_tune/cpu_binding.py``). The worker also writes its pid (for elixir-run's watchdog) and, if the script
raises, the exception's last line (for elixir-run's failure report) into ``$ELIXIR_TUNE_RUN_DIR``. An
error elixir-tune raised on purpose (a refusal: ``refusal_message``) ends the worker there, without a
traceback: elixir-run prints its message in one line, naming the rank.
Imports no torch: the script's own imports come first. The launcher package does not import this
module (python -m would warn that it was imported before it ran).
"""

from __future__ import annotations

import ctypes
import linecache
import os
import runpy
import signal
import sys
import threading
import time

from elixir_tune.cpu_binding import bind_cpu_worker
from elixir_tune.launcher.env import LAUNCHER_PID_ENV, RUN_DIR_ENV
from elixir_tune.launcher.script_guard import refuse_ddp, unused_plan_note
from elixir_tune.plan.io import PLAN_ENV_VAR
from elixir_tune.worker_exit import exit_worker, note_chosen_exit

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# The elixir_tune package: a refusal is raised by its code (refusal_message).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def die_with_parent(launcher_pid: int) -> str:
    """Makes this process end when its parent (elixir-run) ends.

    Args:
        launcher_pid: elixir-run's pid, as it exported it; 0 when unknown.

    Returns:
        How: ``prctl`` or ``poll``.
    """
    how = "poll"
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
                how = "prctl"
        except (OSError, AttributeError):
            pass
    # The parent may have died between our fork and the prctl call: then nothing would fire.
    if launcher_pid and os.getppid() != launcher_pid:
        os._exit(128 + signal.SIGKILL)
    if how == "poll":
        parent = os.getppid()

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="elixir-parent-watch", daemon=True).start()
    return how


def _write(run_dir: str, name: str, text: str) -> bool:
    try:
        with open(os.path.join(run_dir, name), "w") as file:
            file.write(text)
    except OSError:
        return False  # the report is a courtesy; the job must not fail for it
    return True


def main(argv: list[str]) -> None:
    """Runs the script (``argv[0]``) or module (``-m NAME``) with the rest as its arguments."""
    if not argv or argv[:1] == ["-m"] and len(argv) < 2:
        sys.exit("usage: python -m elixir_tune.launcher.worker_main (SCRIPT | -m MODULE) [ARGS...]")
    die_with_parent(int(os.environ.get(LAUNCHER_PID_ENV, "0") or 0))
    # Before the script imports torch, so that its threads start on this worker's cores.
    bind_cpu_worker()
    run_dir = os.environ.get(RUN_DIR_ENV, "")
    rank = os.environ.get("RANK", "0")
    if run_dir:
        _write(run_dir, f"rank{rank}.pid", str(os.getpid()))
        # A restarted worker (torchrun --max-restarts): how the worker it replaces ended is history, and
        # left there it would be reported as this one's if the new group fails.
        for ending in ("error", "refusal", "exit"):
            try:
                os.unlink(os.path.join(run_dir, f"rank{rank}.{ending}"))
            except OSError:
                pass
    refuse_ddp()
    try:
        _run_script(argv)
    except SystemExit as stop:
        _script_ended(stop.code in (0, None))
        if stop.code in (0, None):
            _note_unused_plan(rank)
        else:
            note_chosen_exit(stop.code)
        raise
    except BaseException as error:
        _script_ended(False)
        _report(error, run_dir, rank)
        raise
    _script_ended(True)
    _note_unused_plan(rank)
    # As the recipes end (worker_exit.py): atexit handlers and flushed output, without the
    # interpreter's C++ teardown, where a gloo thread was seen to abort a finished worker.
    exit_worker(0)


def _run_script(argv: list[str]) -> None:
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = list(argv)
        # As `python script.py`: the script's directory first on the path, not ours.
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def _report(error: BaseException, run_dir: str, rank: str) -> None:
    """Writes the error's last line for elixir-run's report. A refusal (``refusal_message``) ends the worker
    here with status 1 and no traceback: elixir-run says it in one line, naming the rank."""
    if not run_dir:
        return
    text = str(error).strip().splitlines()
    _write(run_dir, f"rank{rank}.error", f"{type(error).__name__}: {text[-1] if text else ''}".strip())
    refusal = refusal_message(error)
    if refusal and _write(run_dir, f"rank{rank}.refusal", refusal):
        exit_worker(1)


def refusal_message(error: BaseException) -> str | None:
    """The message, on one line, of an error elixir-tune raised on purpose; None for any other error.

    On purpose: its class is elixir-tune's own (CheckpointError, ContractError, ...), or a ``raise``
    statement in elixir-tune's code raised it (engine/setup.py refuses a plan made for another model
    with a ValueError). Those messages say what is wrong and what to do; a traceback adds only noise.
    A bug (an assertion, a KeyError from a lookup) or an error from torch or the script keeps its traceback.
    """
    message = " ".join(str(error).split())
    if not message or not isinstance(error, Exception) or isinstance(error, AssertionError):
        return None
    if type(error).__module__.startswith("elixir_tune."):
        return message
    innermost = error.__traceback__
    while innermost is not None and innermost.tb_next is not None:
        innermost = innermost.tb_next
    if innermost is None:
        return None
    filename = os.path.abspath(innermost.tb_frame.f_code.co_filename)
    if not filename.startswith(_PACKAGE_DIR + os.sep):
        return None
    return message if linecache.getline(filename, innermost.tb_lineno).lstrip().startswith("raise ") else None


def _script_ended(normally: bool) -> None:
    """Tells the engine, if the script set one up, how the script ended: a normal end serves a rank
    still saving alone before the process leaves (engine/comm/control.py ``script_ended``)."""
    control = sys.modules.get("elixir_tune.engine.comm.control")
    if control is not None:
        control.script_ended(normally)


def _note_unused_plan(rank: str) -> None:
    """Rank 0 says so when a script launched with a plan ended without ever using it."""
    note = unused_plan_note() if rank == "0" and os.environ.get(PLAN_ENV_VAR) else None
    if note:
        print(note, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
