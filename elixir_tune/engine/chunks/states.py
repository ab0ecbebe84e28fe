"""Tensor states of chunked parameters and the transitions allowed between them.

Each trainable parameter in a chunk is in one state. The chunk's behaviour follows from its
parameters' states: a chunk may be evicted when none is COMPUTE, and its gradients are reduced when
every parameter is HOLD_AFTER_BWD or READY_FOR_REDUCE (or at the end of backward for the rest).

    FREE              no gathered data (the chunk is not in the cache); no gradient staged
    HOLD              gathered, idle
    COMPUTE           gathered, a module using it is running (forward, backward or recomputation)
    HOLD_AFTER_BWD    gathered, its gradient for this backward is staged in the chunk
    READY_FOR_REDUCE  gradient staged, gathered data released (evicted while waiting for the rest)
"""

from __future__ import annotations

import enum


class TensorState(enum.Enum):
    FREE = "free"
    HOLD = "hold"
    COMPUTE = "compute"
    HOLD_AFTER_BWD = "hold_after_bwd"
    READY_FOR_REDUCE = "ready_for_reduce"


S = TensorState

# event -> {from state: to state}. Events not listed for a state leave it unchanged (a no-op),
# which is what e.g. "use" means for a parameter whose gradient is already staged.
_TRANSITIONS: dict[str, dict[TensorState, TensorState]] = {
    "gather": {S.FREE: S.HOLD, S.READY_FOR_REDUCE: S.HOLD_AFTER_BWD},
    "release": {S.HOLD: S.FREE, S.HOLD_AFTER_BWD: S.READY_FOR_REDUCE},
    "use": {S.HOLD: S.COMPUTE},
    "done": {S.COMPUTE: S.HOLD},
    "grad": {S.HOLD: S.HOLD_AFTER_BWD, S.COMPUTE: S.HOLD_AFTER_BWD, S.FREE: S.READY_FOR_REDUCE},
    "reduced": {S.HOLD_AFTER_BWD: S.HOLD, S.READY_FOR_REDUCE: S.FREE, S.COMPUTE: S.HOLD},
}

# Transitions that indicate a bug rather than a no-op.
_ILLEGAL: dict[str, set[TensorState]] = {
    "release": {S.COMPUTE},
    "use": {S.FREE, S.READY_FOR_REDUCE},
    "grad": {S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE},
}

GRAD_STAGED = frozenset({S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE})
GATHERED = frozenset({S.HOLD, S.COMPUTE, S.HOLD_AFTER_BWD})


def transition(state: TensorState, event: str) -> TensorState:
    """The state after ``event``.

    Args:
        state: current state.
        event: one of gather, release, use, done, grad, reduced.

    Returns:
        The next state.

    Raises:
        RuntimeError: the event is illegal in this state (an engine bug).
    """
    if state in _ILLEGAL.get(event, ()):
        raise RuntimeError(f"chunk state machine: event {event!r} is illegal in state {state.name}")
    return _TRANSITIONS[event].get(state, state)
