"""elixir-run's roll call at the rendezvous endpoint, before torchrun's own rendezvous.

torchrun's c10d rendezvous waits in silence: a port held by another program makes it talk to that
program until its read timeouts run out (minutes), and a node that never starts leaves the others
waiting for the join timeout (10 minutes by default) with nothing to say who is missing. So before
torchrun starts, every elixir-run of the job meets at the endpoint's TCP store (the same store
torchrun then uses: the node that serves it keeps it open, and torchrun's agent in the same process
shares it) and writes its node rank there. Each one prints a line while it waits, naming the nodes
still missing, and gives up after a bounded time with the list of nodes that never came.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elixir_tune.launcher.checks import parse_endpoint

# How long a TCP listener may take to answer as a store before we call it another program. A store
# answers in about a millisecond; another program that accepts the connection never answers.
STORE_PROBE_S = 3.0
# How long a fresh connection is watched before any store client talks to the listener. A store never
# speaks first nor hangs up on a client that has not spoken; a web server's banner or a program that
# closes at once does so in this time.
FIRST_WORD_S = 0.5
# How often each node's elixir-run counts up its beat in the store while its workers run.
HEARTBEAT_S = 1.0


class RendezvousWaitError(RuntimeError):
    """The roll call failed; the message says why and which nodes are missing."""

    def __init__(self, message: str, hint: str = ""):
        self.hint = hint
        super().__init__(message)


@dataclass
class RollCall:
    """A finished roll call.

    Attributes:
        store: the TCP store at the endpoint; the serving node must keep it open for torchrun.
        serving: whether this process serves the store.
        waited_s: how long the roll call took.
    """

    store: Any
    serving: bool
    waited_s: float
    _beating: threading.Event | None = None

    def start_heartbeat(self, rdzv_id: str, node_rank: int, interval_s: float = HEARTBEAT_S) -> None:
        """Counts up this node's beat in the store every ``interval_s`` until ``stop_heartbeat``: a node whose
        count stands still is gone (killed, crashed, unreachable), whatever the clocks of the machines say."""
        beating = self._beating = threading.Event()

        def beat() -> None:
            while not beating.wait(interval_s):
                try:
                    self.store.add(_beat_key(rdzv_id, node_rank), 1)
                except Exception:  # noqa: BLE001 - the store is gone: the job is ending, torchrun reports it
                    return

        threading.Thread(target=beat, name="elixir-node-heartbeat", daemon=True).start()

    def stop_heartbeat(self, rdzv_id: str, node_rank: int) -> None:
        """Stops the beat and says this node left on purpose (a killed elixir-run cannot say so)."""
        if self._beating is not None:
            self._beating.set()
        try:
            self.store.set(_left_key(rdzv_id, node_rank), "1")
        except Exception:  # noqa: BLE001 - the store is gone already
            pass

    def lost_nodes(self, rdzv_id: str, nnodes: int, node_rank: int, wait_s: float = 3 * HEARTBEAT_S) -> list[str]:
        """The other nodes whose elixir-run stopped beating, each as ``node R (host pid P)``; [] when all beat
        (or the store itself is gone: then the node serving it is the one lost, which torchrun's error says)."""
        others = [rank for rank in range(nnodes) if rank != node_rank]
        try:
            before = {rank: self.store.add(_beat_key(rdzv_id, rank), 0) for rank in others}
            time.sleep(wait_s)
            after = {rank: self.store.add(_beat_key(rdzv_id, rank), 0) for rank in others}
            names = {rank: self.store.get(_key(rdzv_id, rank)).decode() for rank in others}
            still = [rank for rank in others if after[rank] == before[rank]]
            # A node that ended its job itself (its workers failed too) says so before it stops beating.
            lost = [rank for rank in still if not self.store.check([_left_key(rdzv_id, rank)])]
        except Exception:  # noqa: BLE001 - the store went away while we looked
            return []
        return [f"node {rank} ({names[rank]})" for rank in lost]


def free_port_hint() -> int:
    """A port free on this machine now, to suggest in messages."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine (we can bind to its address)."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    with socket.socket() as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def _accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def _store(host: str, port: int, serve: bool, timeout_s: float):
    from torch.distributed import TCPStore

    return TCPStore(
        host,
        port,
        is_master=serve,
        multi_tenant=True,  # torchrun's agent in this process then shares this server
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _speaks_or_hangs_up(host: str, port: int, wait_s: float = FIRST_WORD_S) -> bool:
    """Whether the listener at host:port sends bytes unasked or closes a connection that said nothing:
    another program, told apart in Python. A TCPStore client facing it retries with a page of C++ frames
    on stderr per try, and one still retrying at exit aborts the process (SIGABRT)."""
    try:
        with socket.create_connection((host, port), timeout=2.0) as sock:
            sock.settimeout(wait_s)
            try:
                sock.recv(1)  # a byte (it spoke first) or b"" (it hung up)
            except TimeoutError:
                return False  # silent, as a store is
            return True
    except OSError:
        return True  # refused or reset: nothing that serves a store


def _probe_store(host: str, port: int, timeout_s: float):
    """A client of the store at host:port, or None when what listens there does not answer as one.

    A program that speaks first or hangs up is told apart without a store client. A silent one
    blocks a TCPStore client beyond its own timeout, so the client runs in a daemon thread that is
    abandoned when it does not come back in time.
    """
    if _speaks_or_hangs_up(host, port):
        return None
    result: list[Any] = []

    def connect() -> None:
        try:
            result.append(_store(host, port, serve=False, timeout_s=timeout_s))
        except Exception:  # noqa: BLE001 - any failure means: not a store we can use
            pass

    thread = threading.Thread(target=connect, name="elixir-store-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return result[0] if result else None


def _port_taken(endpoint: str, port: int) -> RendezvousWaitError:
    return RendezvousWaitError(
        f"rendezvous port {port} ({endpoint}) is held by another program that is not an elixir-run "
        "rendezvous (it accepts connections but does not answer as a store)",
        hint=f"choose another port with --rdzv-endpoint HOST:PORT, the same on every node (port "
        f"{free_port_hint()} is free on this machine now), or stop the program holding {port} "
        f"(e.g. `ss -ltnp 'sport = :{port}'` names it)",
    )


def _key(rdzv_id: str, node_rank: int) -> str:
    return f"elixir-run/{rdzv_id}/node{node_rank}"


def _beat_key(rdzv_id: str, node_rank: int) -> str:
    return f"elixir-run/{rdzv_id}/node{node_rank}/beats"


def _left_key(rdzv_id: str, node_rank: int) -> str:
    return f"elixir-run/{rdzv_id}/node{node_rank}/left"


def connect(
    endpoint: str, timeout_s: float, say: Callable[[str], None], report_every_s: float = 10.0, may_serve: bool = True
) -> RollCall:
    """Serves or joins the store at ``endpoint``, waiting (with progress lines) for it to come up.

    Only node 0 serves (``may_serve``): on one machine the first node to start would otherwise serve, and a
    message that blames "the node serving it (node 0)" would name the wrong node when that one is lost.

    Raises:
        RendezvousWaitError: the port is held by another program, or no store came up in time.
    """
    parsed = parse_endpoint(endpoint)
    if parsed is None:
        raise RendezvousWaitError(f"{endpoint!r} is not HOST:PORT", hint="e.g. --rdzv-endpoint 10.0.0.1:29400")
    host, port = parsed
    started = time.monotonic()
    if may_serve and _is_local_address(host):
        try:
            return RollCall(_store(host, port, serve=True, timeout_s=timeout_s), True, 0.0)
        except Exception:  # noqa: BLE001 - the port is taken: by another node's store, or by another program
            store = _probe_store(host, port, STORE_PROBE_S) if _accepts_connections(host, port) else None
            if store is None:
                raise _port_taken(endpoint, port) from None
            return RollCall(store, False, time.monotonic() - started)
    last_report = started
    while True:
        if _accepts_connections(host, port):
            store = _probe_store(host, port, STORE_PROBE_S)
            if store is None:
                raise _port_taken(endpoint, port)
            return RollCall(store, False, time.monotonic() - started)
        now = time.monotonic()
        if now - started > timeout_s:
            raise RendezvousWaitError(
                f"nothing listens at the rendezvous endpoint {endpoint} after {timeout_s:g} s: node 0's "
                "elixir-run did not start there",
                hint=f"start elixir-run on {host} with --rdzv-endpoint {endpoint}, or raise --rdzv-timeout",
            )
        if now - last_report >= report_every_s:
            say(f"waiting for the rendezvous at {endpoint} to open ({now - started:.0f} s of {timeout_s:g} s)")
            last_report = now
        time.sleep(1.0)


def roll_call(
    endpoint: str,
    rdzv_id: str,
    nnodes: int,
    node_rank: int,
    timeout_s: float,
    say: Callable[[str], None],
    report_every_s: float = 10.0,
) -> RollCall:
    """Meets every node of the job at the endpoint before torchrun's rendezvous.

    Args:
        endpoint: HOST:PORT of the rendezvous (node 0's machine serves it).
        rdzv_id: the job id, shared by every node (keys of different jobs do not mix).
        nnodes: how many nodes the job has.
        node_rank: this node's rank.
        timeout_s: how long to wait for every node before giving up.
        say: prints one progress line.
        report_every_s: how often to print while waiting.

    Returns:
        The roll call; keep ``store`` alive until the job ends.

    Raises:
        RendezvousWaitError: the port is held by another program, or not every node came within
            ``timeout_s`` (the message names the missing node ranks and the ones that came).
    """
    started = time.monotonic()
    call = connect(endpoint, timeout_s, say, report_every_s, may_serve=node_rank == 0)
    me = f"{socket.gethostname()} pid {os.getpid()}"
    # Claimed atomically: a second elixir-run given the same --node-rank is told at once, by name, instead of
    # overwriting the first one's claim and waiting until the store closes under it.
    holder = call.store.compare_set(_key(rdzv_id, node_rank), "", me).decode()
    if holder != me:
        raise RendezvousWaitError(
            f"rendezvous at {endpoint}: node {node_rank} is already taken by another elixir-run ({holder})",
            hint=f"give each node its own --node-rank, 0 to {nnodes - 1}",
        )
    last_report = started - report_every_s if nnodes > 1 else started
    present: list[int] = [node_rank]
    names: dict[int, str] = {node_rank: me}
    while True:
        missing = [rank for rank in range(nnodes) if rank not in present]
        missing_text = ", ".join(f"node {rank}" for rank in missing)
        joined = ", ".join(f"node {rank} ({names.get(rank, '?')})" for rank in present)
        try:
            present = [rank for rank in range(nnodes) if call.store.check([_key(rdzv_id, rank)])]
            names = {rank: call.store.get(_key(rdzv_id, rank)).decode() for rank in present}
        except Exception:  # noqa: BLE001 - the serving node ended (it gave up, or was stopped)
            raise RendezvousWaitError(
                f"rendezvous at {endpoint}: the store closed while waiting (the node serving it ended); "
                f"missing: {missing_text} (joined: {joined})",
                hint="see that node's output; start every node with the same --nnodes, --rdzv-endpoint "
                "and --rdzv-id, each with its own --node-rank",
            ) from None
        if names.get(node_rank) != me:
            raise RendezvousWaitError(
                f"rendezvous at {endpoint}: another elixir-run ({names.get(node_rank)}) also joined as node {node_rank}",
                hint=f"give each node its own --node-rank, 0 to {nnodes - 1}",
            )
        missing = [rank for rank in range(nnodes) if rank not in present]
        missing_text = ", ".join(f"node {rank}" for rank in missing)
        joined = ", ".join(f"node {rank} ({names[rank]})" for rank in present)
        elapsed = time.monotonic() - started
        if not missing:
            if nnodes > 1:
                say(f"all {nnodes} nodes joined the rendezvous at {endpoint} ({elapsed:.0f} s)")
            call.waited_s = elapsed
            return call
        if elapsed > timeout_s:
            raise RendezvousWaitError(
                f"rendezvous at {endpoint}: {len(present)} of {nnodes} nodes joined within {timeout_s:g} s; "
                f"missing: {missing_text} (joined: {joined})",
                hint=f"start elixir-run on the missing node(s) with --nnodes {nnodes}, --rdzv-endpoint "
                f"{endpoint}, the same --rdzv-id and their own --node-rank; or raise --rdzv-timeout",
            )
        if time.monotonic() - last_report >= report_every_s:
            say(
                f"waiting at {endpoint} for {missing_text} ({len(present)} of {nnodes} joined: {joined}; "
                f"{elapsed:.0f} s of {timeout_s:g} s)"
            )
            last_report = time.monotonic()
        time.sleep(0.5)
