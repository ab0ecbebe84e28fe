"""elixir-run's watch over this node's workers while torchrun's agent runs them.

Each worker's bootstrap (worker_main) writes ``rank<R>.pid`` into the job's run directory and, when
the script raises, ``rank<R>.error`` with the exception's last line; ``rank<R>.refusal`` holds the
message of an error elixir-tune raised on purpose, and ``rank<R>.exit`` the status of a worker that
ended itself (worker_exit.py). The watch reads them:

* a worker stopped (SIGSTOP, state ``T``) for longer than the collective timeout cannot answer
  its peers and cannot be stopped by the agent's SIGTERM either (a stopped process does not run
  its handlers); the watch says so, names the rank and SIGKILLs it, which ends the job at once
  instead of after the peers' timeouts and the agent's grace period;
* after a failure, the errors and what the watch did explain which rank stopped answering (see
  ``explain``), rather than leaving a SIGKILL that looks like the out-of-memory killer.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

_TIMEOUT_WORDS = re.compile(r"timed? ?out|timeout", re.IGNORECASE)


def process_state(pid: int) -> str:
    """The state letter of a process from /proc (``R``, ``S``, ``T`` ...), or "" when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def is_timeout(message: str) -> bool:
    """Whether a worker's error says it timed out (gloo: "Timed out waiting ... for recv operation")."""
    return bool(_TIMEOUT_WORDS.search(message))


class WorkerWatch:
    """Polls this node's workers; see the module docstring.

    Args:
        run_dir: the job's run directory (``$ELIXIR_TUNE_RUN_DIR`` of the workers).
        stopped_limit_s: how long a worker may stay stopped before it is killed.
        say: prints one line.
        interval_s: how often to look.
    """

    def __init__(self, run_dir: Path, stopped_limit_s: float, say: Callable[[str], None], interval_s: float = 1.0):
        self.run_dir = Path(run_dir)
        self.stopped_limit_s = stopped_limit_s
        self.say = say
        self.interval_s = interval_s
        self.notes: dict[int, str] = {}  # rank -> what the watch saw and did
        self._stopped_since: dict[int, float] = {}  # pid -> first seen stopped
        self._known_pids: dict[int, int] = {}  # rank -> pid last seen (a new pid: torchrun restarted the group)
        self.restarts = 0
        self._restarting: set[int] = set()  # ranks of a restarted group whose new pid has not been seen yet
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="elixir-worker-watch", daemon=True)

    def start(self) -> WorkerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def workers(self) -> dict[int, int]:
        """rank -> pid of the workers started on this node (the latest, after a restart)."""
        found = {}
        for path in self.run_dir.glob("rank*.pid"):
            try:
                found[int(path.stem[4:])] = int(path.read_text())
            except (OSError, ValueError):
                continue  # being written
        return found

    def errors(self) -> dict[int, str]:
        """rank -> the last line of the exception the rank's script raised."""
        return self._read("error")

    def refusals(self) -> dict[int, str]:
        """rank -> the message of an error elixir-tune raised on purpose there (worker_main ``refusal_message``)."""
        return self._read("refusal")

    def ended_on_purpose(self, pid: int) -> bool:
        """Whether the worker with this pid ended itself with its nonzero status (a refusal, ``sys.exit(1)``,
        ``exit_worker(1)``: worker_exit.py), rather than dying of a signal or an unexpected error."""
        ranks = [rank for rank, known in self.workers().items() if known == pid]
        return bool(ranks) and (self.run_dir / f"rank{ranks[0]}.exit").exists()

    def _read(self, ending: str) -> dict[int, str]:
        found = {}
        for path in self.run_dir.glob(f"rank*.{ending}"):
            try:
                found[int(path.stem[4:])] = path.read_text().strip()
            except (OSError, ValueError):
                continue
        return found

    def poll(self) -> None:
        """One look at every worker (the loop calls it; tests may too)."""
        now = time.monotonic()
        workers = self.workers()
        replaced = {rank for rank, pid in workers.items() if self._known_pids.get(rank, pid) != pid}
        # The new workers write their pids one by one: the first new pid of a group starts a restart, the
        # others of that group (still waited for in _restarting) do not start another.
        if replaced - self._restarting:
            self.restarts += 1
            self._restarting = set(self._known_pids)
            self.say(
                f"a worker failed (see above) and torchrun restarted this node's workers (restart {self.restarts}, "
                "--max-restarts); a recipe with --save resumes from its latest checkpoint"
            )
            self.notes.clear()  # what was seen of the old workers does not describe the new ones
        self._restarting -= replaced
        self._known_pids.update(workers)
        for rank, pid in workers.items():
            if process_state(pid) != "T":
                self._stopped_since.pop(pid, None)
                continue
            since = self._stopped_since.setdefault(pid, now)
            if now - since < self.stopped_limit_s or rank in self.notes:
                continue
            self.notes[rank] = (
                f"was stopped (SIGSTOP) and did not answer for {self.stopped_limit_s:g} s (the collective "
                "timeout), so elixir-run killed it"
            )
            self.say(
                f"rank {rank} (pid {pid}) has been stopped for {now - since:.0f} s and answers no one; ending the job"
            )
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _loop(self) -> None:
        while not self._done.wait(self.interval_s):
            self.poll()
