"""Token-weighted accumulation (engine/token_weights.py) against plain PyTorch on the whole batch.

A tiny GPT-2, 3 micro-batches per rank, labels masked (-100) over a random prompt of every row so that
each micro-batch and each data rank counts different loss tokens; 3 AdamW steps through
``forward_backward`` on a data plan (2 data ranks, standard and layered accumulation; and the plain
loop with ``model.token_weights``), a pipeline plan (2 stages) and a tensor plan (degree 2), in one
launch of 2 ranks. The step's loss (the mean of the ranks' returned shares) must equal the loss of the
whole global batch to 1e-6 relative and the weights plain PyTorch's to 1e-5 absolute; averaging the
micro-batch means instead misses both by far (checked on the same batches).
"""

from __future__ import annotations

import pytest

from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LOSS_REL = 1e-6
WEIGHT_ABS = 1e-5
CASES = [
    dict(shape="data"),
    dict(shape="data", accumulation="layered"),
    dict(shape="data", loop="plain"),
    dict(shape="pipeline"),
    dict(shape="tensor"),
]


@pytest.fixture(scope="module")
def results():
    return launch("token_weights_worker.py", CASES, world_size=2, timeout_s=300)


@pytest.mark.parametrize("index", range(len(CASES)), ids=["-".join(map(str, c.values())) for c in CASES])
def test_uneven_masks_give_the_whole_batch_loss_and_weights(results, index):
    ranks = [rank_results[index] for rank_results in results]
    assert all(r["ok"] for r in ranks), [r.get("trace") for r in ranks]
    first = ranks[0]
    # The masks do leave the micro-batches uneven (else this test would test nothing).
    assert any(len(set(step)) > 1 for step in first["counts"])
    if first["case"]["shape"] == "data":
        assert ranks[0]["counts"] != ranks[1]["counts"]
    assert first["unweighted_rel"] > 100 * LOSS_REL  # what averaging the micro-batch means would give
    assert first["loss_rel"] <= LOSS_REL, (first["world_losses"], first["ref_losses"])
    assert first["weight_abs"] <= WEIGHT_ABS
