"""The all-to-all traffic of expert parallelism (engine/parallel/expert_parallel.py), per rank.

Each mixture-of-experts block sends every (token, chosen expert) row of this rank's micro-batch to the
rank holding that expert and gets the output row back: two all-to-alls forward (dispatch, return) and
the same two backward (their gradients). With routing spread evenly over the E ranks of the expert
group, a fraction (E - 1) / E of the rows leaves the rank, so one all-to-all moves

    (E - 1) / E x tokens x top_k x hidden x bytes per element

out of each rank (and as much in). Skewed routing moves more to the busiest rank; the even split is
the figure the search compares layouts by. Imports no torch.
"""

from __future__ import annotations

__all__ = ["expert_all_to_all_bytes"]

# All-to-alls per block and micro-batch: dispatch and return forward, their gradients backward.
ALL_TO_ALLS_PER_BLOCK = 4


def expert_all_to_all_bytes(
    degree: int, tokens: int, hidden_size: int, experts_per_token: int, moe_blocks: int, element_bytes: int
) -> int:
    """Bytes one rank sends in the all-to-alls of expert parallelism for one micro-batch (forward
    and backward; it receives as many).

    Args:
        degree: expert degree E (1: no traffic).
        tokens: tokens of the micro-batch (micro_batch_size x seq_len).
        hidden_size: the rows' width (the residual stream).
        experts_per_token: top-k of the router.
        moe_blocks: blocks with routed experts.
        element_bytes: bytes per element of the compute dtype.

    Returns:
        Bytes sent by this rank.
    """
    if degree <= 1:
        return 0
    rows_out = tokens * experts_per_token * (degree - 1) / degree
    return round(ALL_TO_ALLS_PER_BLOCK * moe_blocks * rows_out * hidden_size * element_bytes)
