"""Running torchrun in this process and turning its outcome into an exit status and a message.

torchrun's agent watches the workers: when one dies (killed, crashed, non-zero exit) it stops
the others (SIGTERM, then SIGKILL after a grace period) and raises ChildFailedError; when the
agent itself gets SIGINT/SIGTERM it forwards the signal to the workers, waits for them and
raises SignalException. Workers run in their own sessions, so a terminal's Ctrl-C reaches only
elixir-run, which then stops them through the agent.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import signal
from dataclasses import dataclass, field

from elixir_tune.launcher.argv import LaunchSpec, compose_torchrun_argv
from elixir_tune.launcher.watch import WorkerWatch, is_timeout

# The logger of torchrun's agent's line for each failed worker group ("failed (exitcode: N) local_rank: L
# (pid: P) of binary: ..."), which elixir-run leaves out for a worker that ended on purpose (_QuietChosenExits).
_TORCHRUN_FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_HANDLED_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)
# Signals the agent itself sends to stop the surviving workers after the first failure.
_AGENT_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


@dataclass
class WorkerFailure:
    """One failed worker, as torchrun reported it.

    Attributes:
        rank: global rank.
        local_rank: rank on its node.
        pid: process id.
        exit_code: exit status; negative -N when killed by signal N.
        message: the worker's recorded error, when it left one.
    """

    rank: int
    local_rank: int
    pid: int
    exit_code: int
    message: str = ""
    note: str = ""  # what elixir-run's watch found out about it

    @property
    def signal_name(self) -> str:
        if self.exit_code >= 0:
            return ""
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:
            return f"signal {-self.exit_code}"

    def describe(self) -> str:
        how = f"was killed by {self.signal_name}" if self.exit_code < 0 else f"exited with code {self.exit_code}"
        return f"rank {self.rank} (local rank {self.local_rank}, pid {self.pid}) {how}" + (
            f" ({self.note})" if self.note else ""
        )


@dataclass
class LaunchOutcome:
    """How the job ended.

    Attributes:
        exit_code: the job's exit status: 0, the failed worker's code, or 128 + signal number.
        message: what went wrong, naming the failed rank(s); empty on success.
        hint: what to look at next.
        failures: every failed worker torchrun reported, root cause first.
    """

    exit_code: int
    message: str = ""
    hint: str = ""
    failures: list[WorkerFailure] = field(default_factory=list)


def exit_code_of(failure: WorkerFailure) -> int:
    """Shell convention: a worker killed by signal N gives 128 + N."""
    return failure.exit_code if failure.exit_code >= 0 else 128 + (-failure.exit_code)


def order_failures(failures: list[WorkerFailure]) -> list[WorkerFailure]:
    """Root cause first: a worker the watch found stopped answering, a worker killed by a signal
    the agent does not send (SIGKILL, SIGSEGV, ...), then workers that exited with an error, then
    those the agent stopped (SIGTERM, SIGINT); torchrun's order (first observed) within each group."""

    def group(failure: WorkerFailure) -> int:
        if failure.note:  # elixir-run's watch found it stopped answering
            return -1
        if failure.exit_code >= 0:
            return 1
        return 2 if -failure.exit_code in _AGENT_STOP_SIGNALS else 0

    return sorted(failures, key=group)


def describe_failures(failures: list[WorkerFailure]) -> str:
    """One sentence naming the failed ranks, root cause first."""
    ordered = order_failures(failures)
    text = "worker " + ordered[0].describe()
    if ordered[0].message:
        text += f": {ordered[0].message}"
    if len(ordered) > 1:
        text += "; then " + "; ".join(failure.describe() for failure in ordered[1:])
    return text


def add_watch_findings(failures: list[WorkerFailure], watch: WorkerWatch) -> list[WorkerFailure]:
    """Fills in what the watch knows and puts the rank that stopped answering first.

    A rank the watch killed for being stopped is the root cause. Otherwise, when some ranks timed
    out in a collective (their error says so) and others did not fail by themselves (the agent
    stopped them afterwards), those others are the ones that stopped answering.
    """
    errors = watch.errors()
    for failure in failures:
        if not failure.message and failure.rank in errors:
            failure.message = errors[failure.rank]
        failure.note = watch.notes.get(failure.rank, "")
    killed = [failure for failure in failures if failure.note]
    waiters = [failure for failure in failures if is_timeout(failure.message)]
    silent = [
        failure
        for failure in failures
        if not failure.note and failure.exit_code < 0 and -failure.exit_code in _AGENT_STOP_SIGNALS
    ]
    if not killed and waiters and silent:
        waited = ", ".join(str(failure.rank) for failure in waiters)
        for failure in silent:
            failure.note = f"it stopped answering: rank(s) {waited} timed out waiting for it in a collective"
        killed = silent
    return killed + [failure for failure in failures if failure not in killed]


def lost_node_outcome(outcome: LaunchOutcome, lost: list[str]) -> LaunchOutcome:
    """A failed job whose cause is another node that went away: that node named first, the workers after.

    Args:
        outcome: this node's failed outcome (its workers failed because their peers on the lost node did).
        lost: the nodes whose elixir-run stopped beating without leaving (``RollCall.lost_nodes``).

    Returns:
        The outcome with a message that names the lost node(s) and a hint of what to do.
    """
    which = ", ".join(lost)
    return dataclasses.replace(
        outcome,
        message=f"lost {which}: its elixir-run stopped while the job ran (killed, crashed, or its machine "
        f"unreachable), and this node's workers stopped with it ({outcome.message.removeprefix('the job failed: ')})",
        hint="see that node's output and system log (dmesg: the out-of-memory killer); then start the job again on "
        "every node (with --resume DIR when it saved checkpoints)",
    )


def refusal_outcome(failures: list[WorkerFailure], refusals: dict[int, str]) -> LaunchOutcome | None:
    """The job's end when its first failure is a refusal (an error elixir-tune raised on purpose in a worker,
    worker_main ``refusal_message``): its message once, naming every rank that refused alike.

    Args:
        failures: the failed workers, root cause first (``order_failures``, ``add_watch_findings``).
        refusals: rank -> the refusal it recorded (``WorkerWatch.refusals``).

    Returns:
        The outcome, or None when the first failure is something else (then the full report stands).
    """
    root = failures[0]
    message = refusals.get(root.rank)
    if message is None or root.note:
        return None
    ranks = sorted(failure.rank for failure in failures if refusals.get(failure.rank) == message)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    return LaunchOutcome(exit_code_of(root), f"{who}: {message}", failures=failures)


class _QuietChosenExits(logging.Filter):
    """Leaves out torchrun's failure line for a worker that ended itself on purpose (a refusal, ``sys.exit(1)``,
    a recipe's ``exit_worker(1)`` after its error line): the worker said why, and elixir-run's own report names
    the rank and status. A worker that died of a signal or an unexpected error keeps torchrun's line."""

    def __init__(self, watch: WorkerWatch):
        super().__init__()
        self.watch = watch

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if not str(record.msg).startswith("failed (exitcode") or len(args) < 3:
            return True
        pid = str(args[2])  # torchrun's format: exitcode, local rank, pid, binary
        return not (pid.isdigit() and self.watch.ended_on_purpose(int(pid)))


def _close_torchrun_rendezvous() -> None:
    """Ends torchrun's rendezvous keep-alive thread from this (the main) thread after a signal.

    On a signal torchrun's launcher leaves its rendezvous handler open (a restarted agent could rejoin), so the
    handler's keep-alive thread runs on until the handler is collected, whose finalizer then joins that thread.
    Collected by a garbage collection that ran in that very thread, it printed "Exception ignored in:
    <finalize object ...> RuntimeError: cannot join current thread" after the job had saved and stopped.
    The handler is unreachable once torchrun's exception is gone: collected here, the join runs here.
    """
    gc.collect()


def _failures_from(error) -> list[WorkerFailure]:
    failures = []
    # torchrun's failures map rank -> failure; order them as first observed, as torchrun does.
    for rank, failure in sorted(error.failures.items(), key=lambda item: (item[1].timestamp, item[0])):
        message = failure.message if isinstance(failure.message, str) else str(failure.message.get("message", ""))
        if message.startswith("To enable traceback") or message.startswith("Signal "):
            message = ""  # torchrun's placeholders, not the worker's words
        failures.append(
            WorkerFailure(
                rank=int(rank),
                local_rank=int(failure.local_rank),
                pid=int(failure.pid),
                exit_code=int(failure.exitcode),
                message=message.strip().splitlines()[-1] if message.strip() else "",
            )
        )
    return order_failures(failures)


def run_torchrun(spec: LaunchSpec, watch: WorkerWatch | None = None) -> LaunchOutcome:
    """Runs `torch.distributed.run` in this process as ``spec`` says and waits for the job.

    The current environment is the workers' environment (torchrun copies it). torchrun's parser
    reads only its own options and the script; the script's arguments are set afterwards, because
    argparse rejects a script argument that abbreviates a torchrun option (``--log`` looks like
    ``--log-dir``) even after the script name.

    Args:
        spec: the launch (see compose_torchrun_argv).
        watch: elixir-run's watch over the workers (started by the caller), whose findings go
            into the failure report.

    Returns:
        The outcome; never raises for a failed job, a signal or a failed rendezvous.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    args = torchrun.parse_args(compose_torchrun_argv(dataclasses.replace(spec, script_args=())))
    # With the bootstrap, the parsed arguments already hold the script (worker_main's first argument).
    args.training_script_args = [*args.training_script_args, *spec.script_args]
    saved_handlers = {sig: signal.getsignal(sig) for sig in _HANDLED_SIGNALS}
    quiet = _QuietChosenExits(watch) if watch is not None else None
    signalled = False
    if quiet is not None:
        logging.getLogger(_TORCHRUN_FAILURE_LOGGER).addFilter(quiet)
    try:
        torchrun.run(args)
        return LaunchOutcome(0)
    except ChildFailedError as error:
        failures = _failures_from(error)
        if watch is not None:
            failures = add_watch_findings(failures, watch)
        if not failures:
            return LaunchOutcome(1, f"the job failed: {error}")
        refused = refusal_outcome(failures, watch.refusals()) if watch is not None else None
        if refused is not None:
            return refused
        root = failures[0]
        hint = "the worker's output above shows why"
        if root.note:
            hint = (
                "a rank that stops answering (stopped, hung, or waiting on something else) makes the others "
                "time out after the collective timeout (--collective-timeout)"
            )
        elif root.exit_code == -signal.SIGKILL:
            hint += "; a worker killed by SIGKILL that nobody killed is often the out-of-memory killer (see dmesg)"
        return LaunchOutcome(
            exit_code_of(root), f"the job failed: {describe_failures(failures)}", hint=hint, failures=failures
        )
    except SignalException as error:
        name = signal.Signals(error.sigval).name
        signalled = True
        return LaunchOutcome(128 + int(error.sigval), f"interrupted by {name}; the workers were stopped")
    except KeyboardInterrupt:
        return LaunchOutcome(128 + signal.SIGINT, "interrupted by SIGINT before the workers started")
    except RendezvousError as error:
        endpoint = getattr(args, "rdzv_endpoint", "") or "this node"
        if watch is not None and watch.workers():
            # The workers had started: the store went away mid-job, with the node that served it.
            return LaunchOutcome(
                1,
                f"lost the rendezvous store at {endpoint} during the job ({type(error).__name__}): the node "
                "serving it (node 0) ended or became unreachable; this node's workers were stopped",
                hint="see node 0's output for why it ended",
            )
        detail = str(error).strip() or (
            f"not all {args.nnodes} nodes joined within the join timeout (600 s unless "
            "--rdzv-conf join_timeout=SECONDS)"
            if type(error).__name__ == "RendezvousTimeoutError"
            else ""
        )
        return LaunchOutcome(
            1,
            f"rendezvous at {endpoint} failed: {type(error).__name__}" + (f": {detail}" if detail else ""),
            hint="start elixir-run on every node with the same --rdzv-endpoint, --rdzv-id "
            "and --nnodes, each with its own --node-rank; check that the endpoint's "
            "host is reachable from every node",
        )
    finally:
        if quiet is not None:
            logging.getLogger(_TORCHRUN_FAILURE_LOGGER).removeFilter(quiet)
        if signalled:
            _close_torchrun_rendezvous()
        # torchrun leaves its raising handlers installed; later signals must behave normally.
        for sig, handler in saved_handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
