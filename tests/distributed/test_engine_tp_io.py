"""A tensor-parallel fine-tune from a Hugging Face directory (gloo, CPU, world 2, tensor 2).

One launch (``engine_tp_io_worker.py``): a tiny Llama written by transformers' ``save_pretrained``;
the engine starts from it on the meta device (each rank reads its pieces), trains, saves a sharded
checkpoint and a ``save_pretrained`` directory that plain transformers reads back equal to the
engine's weights; a fresh run resumed from the checkpoint continues bitwise, and a data-parallel plan
resumes from it with the weights only and a warning.
"""

from __future__ import annotations

import pytest

from tests.distributed.engine_launch import launch
from tests.distributed.engine_plans import tiny_llama_gqa

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-io")
    tiny_llama_gqa(seed=3).save_pretrained(root / "hf")
    case = {"weights": str(root / "hf"), "out": str(root / "out")}
    return launch("engine_tp_io_worker.py", [case], 2, timeout_s=300)


def test_tensor_parallel_fine_tune_from_hf_dir(results):
    for rank, (result,) in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
        # The model started on the meta device; every parameter is real now, the projections split.
        assert result["meta_left"] == []
        assert "model.layers.0.self_attn.q_proj.weight" in result["split"]
        assert "model.embed_tokens.weight" in result["split"]
        assert result["rank_files"] == ["rank-00000.pt", "rank-00001.pt"]
        assert result["resume_exact"] is True
        assert result["resumed_losses_equal"] is True
        assert result["dp_exact"] is False
        assert any("tensor degree 2 then, 1 now" in w and "weights only" in w for w in result["dp_warnings"])
        assert result["dp_differs"] == []
    first = results[0][0]
    assert first["start_differs"] == []  # the pieces read equal the directory's tensors
    assert first["pretrained_keys"] > 0 and first["pretrained_differs"] == []
    assert first["resumed_differs"] == []
    assert results[0][0]["losses"] == results[1][0]["losses"]  # the tensor group computes one loss
