"""The chunk tensor-state machine."""

import pytest

from elixir_tune.engine.chunks.states import TensorState as S
from elixir_tune.engine.chunks.states import transition


def test_forward_backward_cycle():
    state = transition(S.FREE, "gather")
    assert state is S.HOLD
    state = transition(state, "use")
    assert state is S.COMPUTE
    state = transition(state, "grad")
    assert state is S.HOLD_AFTER_BWD
    state = transition(state, "release")
    assert state is S.READY_FOR_REDUCE
    state = transition(state, "gather")
    assert state is S.HOLD_AFTER_BWD
    assert transition(state, "use") is S.HOLD_AFTER_BWD  # gradient staged: no more compute
    assert transition(state, "reduced") is S.HOLD
    assert transition(S.READY_FOR_REDUCE, "reduced") is S.FREE


@pytest.mark.parametrize(
    "state,event", [(S.COMPUTE, "release"), (S.FREE, "use"), (S.HOLD_AFTER_BWD, "grad"), (S.READY_FOR_REDUCE, "use")]
)
def test_illegal_transitions_raise(state, event):
    with pytest.raises(RuntimeError, match="illegal"):
        transition(state, event)


def test_gradient_of_a_released_parameter_waits_for_reduce():
    assert transition(S.FREE, "grad") is S.READY_FOR_REDUCE
