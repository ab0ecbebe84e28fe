"""Forwards and state dicts that only some ranks run: DDP habits on a sharded model.

Under DDP every rank holds the whole model, so scripts evaluate and save on rank 0 alone (nanoGPT
does both). Here a forward gathers chunks from every rank of the data group. Run on rank 0 alone,
its gathers would wait for ranks already in their next training forward (a hang), or pair with that
forward's gathers. So, on a plan whose forward has collectives, every rank says at the start of each
forward and state dict what it is about to do, in one exchange of three integers over the control
channel (engine/comm/control.py):

* all the same: each goes on at once;
* one rank evaluates (a forward under ``torch.no_grad()``) or asks for the model's or the
  optimizer's state dict while the
  others wait in a training forward (or in a state dict): that rank leads. The others follow: they
  replay the leader's engine steps (each module's chunk fetch and release, each state dict gather)
  without computing anything, so every gather has its partners and every rank's cache ends in the
  same state. When the leader starts what the others wait for, all go on together;
* one rank evaluates or asks for a state dict while the others wait at the end of the script, in
  ``dist.barrier()`` or in ``dist.destroy_process_group()`` (a DDP script's last act: rank 0 saves,
  then all meet; engine/comm/control.py ``settle_before_world_waits``): the others follow it there
  too, and go on when it arrives;
* anything else raises the same clear error on every rank, naming the ranks and what each does.

A plan with tensor or expert parallelism computes collectives inside the model itself: there only
the error is possible, before any collective that would hang.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elixir_tune.engine.comm.control import ControlChannel, ControlTimeout, settle_before_world_waits

# What a rank is about to do; a higher number leads a lower one.
BARRIER, TRAIN, STATE, OPTIM, EVAL = -1, 0, 1, 2, 3
KIND_NAMES = {
    BARRIER: "a barrier or the end of the script",
    TRAIN: "a training forward",
    STATE: "model.state_dict()",
    OPTIM: "optimizer.state_dict()",
    EVAL: "a forward under torch.no_grad()",
}
# What a row of an exchange says: a follower waits; a leader enters a new kind or runs a module hook.
WAIT, ENTER, PRE, POST = 0, 1, 2, 3


class UnevenForwardError(RuntimeError):
    """Ranks run different forwards or state dicts in a way the engine cannot pair up."""


@dataclass
class Replay:
    """What a follower runs for the leader (the engine's own steps, without compute).

    Attributes:
        begin: the start of a forward (the cache's new micro-batch).
        pre_forward: module number -> the module's forward pre-hook work (fetch its chunks).
        post_forward: module number -> the module's forward hook work (release them).
        state_dict: all_ranks -> the engine's full state dict gathers.
        optimizer_state: the optimizer state's gathers (``optimizer.state_dict()``).
    """

    begin: Callable[[], None]
    pre_forward: Callable[[int], None]
    post_forward: Callable[[int], None]
    state_dict: Callable[[bool], None]
    optimizer_state: Callable[[], None]


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class ForwardAgreement:
    """This rank's side of the agreement on forwards and state dicts.

    Args:
        channel: the control channel over every rank.
        replay: the engine steps a follower replays.
        refusal: None when one rank may lead (a data-parallel plan); otherwise why it may not, said
            in the error (e.g. "under tensor parallelism every rank of a tensor group computes
            each forward together").
    """

    def __init__(self, channel: ControlChannel, replay: Replay, refusal: str | None = None):
        self.channel = channel
        self.replay = replay
        self.refusal = refusal
        self.leading = False

    def enter(self, kind: int, all_ranks: bool = False) -> None:
        """Called by each rank at the start of a forward (``TRAIN`` or ``EVAL``) or a state dict
        (``STATE``); returns when this rank may run it (after following others, when needed).

        Raises:
            UnevenForwardError: the ranks cannot be paired (the same message on every rank), or some
                rank never came within the collective timeout.
        """
        if kind != BARRIER and isinstance(self.channel, ControlChannel):
            settle_before_world_waits(self.settle)  # the one a barrier or the exit settles from now on
        rows = self._exchange([ENTER, kind, int(all_ranks)], kind)
        while True:
            leader = self._leader(rows)
            self.leading = leader == self.channel.rank
            if leader is None or self.leading:
                return
            rows = self._follow(leader, rows[leader], kind, all_ranks)

    def settle(self) -> None:
        """Called before this rank waits for the world (a barrier, the group's teardown, the exit):
        serves a rank that evaluates or saves alone until every rank arrives here too.

        Raises:
            UnevenForwardError: another rank runs a training forward instead, or never comes.
        """
        self.enter(BARRIER)

    def announce(self, op: int, module_index: int) -> None:
        """A leader's module hook (``PRE`` or ``POST``): its followers replay it (called while leading)."""
        self._exchange([op, module_index, 0], EVAL)

    def require_even(self, what: str) -> None:
        """Raises when this rank leads (the others wait in a forward) and now runs ``what``, a
        collective they will not join."""
        if self.leading:
            raise UnevenForwardError(
                f"rank {self.channel.rank} ran a forward or state dict alone (the other ranks wait for it in "
                f"their next forward) and then {what}, which needs every rank; evaluate or save alone only "
                "where the other ranks are about to run a forward, e.g. at the top of the training loop"
            )

    # --- internals -----------------------------------------------------------------------------

    def _exchange(self, row: list[int], kind: int) -> list[list[int]]:
        try:
            return self.channel.all_gather_ints(row)
        except ControlTimeout as error:
            # Not gloo's own words: elixir-run's summary reads those as "this rank waited for a silent one".
            what = (
                f"did not come within {self.channel.timeout_s:.0f} s"
                if "timed out" in str(error).lower()
                else "left (a rank stopped)"
            )
            raise UnevenForwardError(
                f"rank {self.channel.rank} waited for the other ranks at the start of {KIND_NAMES[kind]} and they "
                f"{what}: a rank stopped, or runs a collective (an optimizer step, a barrier, a save) the others "
                "do not; under elixir-tune every rank holds only a shard, so every rank must reach each forward "
                "(a rank may evaluate or save alone only where the others are about to run a forward)"
            ) from None

    def _leader(self, rows: list[list[int]]) -> int | None:
        """None when every rank is about to do the same; else the rank the others follow.

        Raises:
            UnevenForwardError: no single rank can lead (or the plan allows none).
        """
        kinds = [row[1] for row in rows]
        if len(set(kinds)) == 1:
            return None
        top = max(kinds)
        leaders = [rank for rank, kind in enumerate(kinds) if kind == top]
        groups = {kind: [rank for rank, k in enumerate(kinds) if k == kind] for kind in dict.fromkeys(kinds)}
        said = "; ".join(f"{_ranks_text(ranks)}: {KIND_NAMES[kind]}" for kind, ranks in groups.items())
        if self.refusal is not None:
            raise UnevenForwardError(
                f"the ranks are about to run different things ({said}); {self.refusal}: run every forward and "
                "state dict on every rank (each rank may evaluate its own share of the batches)"
            )
        if top == TRAIN:  # the others wait at a barrier: a training forward alone cannot be served
            raise UnevenForwardError(
                f"the ranks are about to run different things ({said}); a rank that trains needs every rank "
                "in its forward and backward: every rank must run the same number of training steps"
            )
        if len(leaders) > 1 or len(groups) > 2:
            raise UnevenForwardError(
                f"the ranks are about to run different things ({said}); one rank at a time may evaluate or read "
                "the state dict alone while the others wait in their next forward: evaluate on one rank, or on "
                "every rank"
            )
        return leaders[0]

    def _follow(self, leader: int, entry: list[int], kind: int, all_ranks: bool) -> list[list[int]]:
        """Replays the leader's steps until it enters something new; that exchange's rows."""
        self._replay_entry(entry)
        while True:
            rows = self._exchange([WAIT, kind, int(all_ranks)], kind)
            op, value, _ = rows[leader]
            if op == ENTER:
                return rows
            if op == PRE:
                self.replay.pre_forward(value)
            elif op == POST:
                self.replay.post_forward(value)

    def _replay_entry(self, entry: list[int]) -> None:
        _, kind, flag = entry
        if kind == STATE:
            self.replay.state_dict(bool(flag))
        elif kind == OPTIM:
            self.replay.optimizer_state()
        else:
            self.replay.begin()
