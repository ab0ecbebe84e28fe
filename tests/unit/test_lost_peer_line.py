"""A step that fails because another worker died ends in one line, whichever collective noticed it."""

from __future__ import annotations

from elixir_tune.engine.uneven import UnevenForwardError
from elixir_tune.recipes.restarts import lost_peer_line


def test_gloo_and_the_forward_agreement_both_name_a_lost_peer_in_one_line():
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
    assert "(gloo: connection closed by peer)" in lost_peer_line(gloo, 0, 7)
    # A worker killed while the others wait at the start of a forward: the control channel notices first.
    agreement = UnevenForwardError(
        "rank 0 waited for the other ranks at the start of a training forward and they left (a rank stopped): ..."
    )
    line = lost_peer_line(agreement, 0, 7)
    assert line is not None and "another worker went away during step 7 (the forward agreement" in line
    assert lost_peer_line(UnevenForwardError("the ranks are about to run different things"), 0, 7) is None
