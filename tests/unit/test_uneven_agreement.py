"""The agreement on forwards that only some ranks run (engine/uneven.py), decided from every rank's
row of one exchange: who leads, and when it is refused. The exchange itself runs over real
processes in tests/dropin/; here a channel stand-in returns fixed rows (our own interface, not torch's)."""

from __future__ import annotations

import pytest

from elixir_tune.engine.uneven import (
    BARRIER,
    ENTER,
    EVAL,
    OPTIM,
    POST,
    PRE,
    STATE,
    TRAIN,
    WAIT,
    ForwardAgreement,
    Replay,
)
from elixir_tune.engine.uneven import UnevenForwardError as Uneven


class Rows:
    """A channel whose exchanges return the given rows in turn, recording what this rank sent."""

    def __init__(self, rank: int, answers: list[list[list[int]]]):
        self.rank, self.timeout_s, self.answers, self.sent = rank, 5.0, list(answers), []

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        self.sent.append(values)
        return self.answers.pop(0)


def agreement(rank: int, answers, refusal=None):
    done: list[tuple] = []
    replay = Replay(
        begin=lambda: done.append(("begin",)),
        pre_forward=lambda index: done.append(("pre", index)),
        post_forward=lambda index: done.append(("post", index)),
        state_dict=lambda all_ranks: done.append(("state", all_ranks)),
        optimizer_state=lambda: done.append(("optimizer",)),
    )
    return ForwardAgreement(Rows(rank, answers), replay, refusal), done  # type: ignore[arg-type]


def test_ranks_that_agree_go_on_at_once():
    agree, done = agreement(1, [[[ENTER, TRAIN, 0], [ENTER, TRAIN, 0]]])
    agree.enter(TRAIN)
    assert not agree.leading and done == []


def test_a_rank_evaluating_alone_leads_and_the_others_replay_its_hooks_until_it_trains():
    leader_rows = [[ENTER, EVAL, 0], [ENTER, TRAIN, 0]]
    follower, done = agreement(
        1,
        [
            leader_rows,
            [[PRE, 3, 0], [WAIT, TRAIN, 0]],
            [[POST, 3, 0], [WAIT, TRAIN, 0]],
            [[ENTER, STATE, 1], [WAIT, TRAIN, 0]],  # then the leader reads the state dict alone
            [[ENTER, OPTIM, 0], [WAIT, TRAIN, 0]],  # and the optimizer's (nanoGPT's checkpoint)
            [[ENTER, TRAIN, 0], [WAIT, TRAIN, 0]],  # and starts training: all go on
        ],
    )
    follower.enter(TRAIN)
    assert done == [("begin",), ("pre", 3), ("post", 3), ("state", True), ("optimizer",)]
    assert not follower.leading
    leader, _ = agreement(0, [leader_rows])
    leader.enter(EVAL)
    assert leader.leading
    with pytest.raises(Uneven, match="rank 0 ran a forward or state dict alone .* then called optimizer.step"):
        leader.require_even("called optimizer.step()")


@pytest.mark.parametrize(
    "kinds, message",
    [
        ([EVAL, EVAL, TRAIN], "one rank at a time may evaluate"),
        ([EVAL, STATE, TRAIN], "one rank at a time may evaluate"),
    ],
)
def test_two_leaders_are_refused_on_every_rank_naming_them(kinds, message):
    rows = [[ENTER, kind, 0] for kind in kinds]
    agree, _ = agreement(2, [rows])
    with pytest.raises(Uneven, match=message) as raised:
        agree.enter(kinds[2])
    assert "ranks 0, 1: a forward under torch.no_grad()" in str(raised.value) or "rank 1: model.state_dict()" in str(
        raised.value
    )


def test_a_tensor_parallel_plan_refuses_any_mismatch_with_its_reason():
    agree, _ = agreement(1, [[[ENTER, EVAL, 0], [ENTER, TRAIN, 0]]], refusal="under tensor parallelism ...")
    with pytest.raises(Uneven, match=r"rank 0: a forward under torch.no_grad\(\); rank 1: a training forward"):
        agree.enter(TRAIN)


def test_ranks_at_the_end_serve_a_rank_that_saves_alone_until_it_arrives():
    # Rank 0 reads the state dict alone while rank 1 waits in dist.barrier() (a DDP script's last act).
    follower, done = agreement(
        1,
        [
            [[ENTER, STATE, 0], [ENTER, BARRIER, 0]],
            [[ENTER, OPTIM, 0], [WAIT, BARRIER, 0]],
            [[ENTER, BARRIER, 0], [WAIT, BARRIER, 0]],  # rank 0 reaches the barrier too: both go on
        ],
    )
    follower.settle()
    assert done == [("state", False), ("optimizer",)] and not follower.leading
    assert follower.channel.sent[0] == [ENTER, BARRIER, 0]


def test_a_training_forward_while_another_rank_waits_at_the_end_is_refused_at_once():
    agree, _ = agreement(1, [[[ENTER, TRAIN, 0], [ENTER, BARRIER, 0]]])
    with pytest.raises(Uneven, match="rank 0: a training forward; rank 1: a barrier or the end of the script"):
        agree.settle()
