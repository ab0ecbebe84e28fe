"""MPT's activations in the published comparison (issue 38: memory refused configurations that ran).

llm-foundry's MPT trains without dropout and with flash-attn's fused cross-entropy; the GPT-2
stand-in profile counted two dropout masks per block and an fp32 copy of the logits, so its
MPT-760m at micro-batch 24 x 2048 tokens on 8 x H100 (a published run, 63147 tokens/s per GPU)
was refused by the search as over the card.
"""

from __future__ import annotations

import pytest

from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.search import InfeasibleError, search

SHAPE = {"hidden": 1536, "layers": 24, "heads": 12, "vocab": 50368, "positions": 2048, "seq_len": 2048}


def _mpt_760m(**kwargs):
    return gpt2_profile("mpt-760m", dtype="bf16", flash_attention=True, **SHAPE, **kwargs)


def test_no_dropout_and_a_fused_loss_drop_their_bytes_exactly():
    gpt2 = _mpt_760m()
    mpt = _mpt_760m(dropout=False, fused_loss=True)
    masks = SHAPE["layers"] * SHAPE["seq_len"] * SHAPE["hidden"] * 2  # two 1-byte masks per block
    fp32_logits = SHAPE["seq_len"] * SHAPE["vocab"] * 4
    assert gpt2.activation.per_sample_bytes - mpt.activation.per_sample_bytes == masks + fp32_logits


def _pinned(profile):
    return search(
        profile,
        load_hardware("h100-80gb-sxm"),
        gpus_per_node=8,
        nodes=1,
        global_batch_size=24 * 2 * 8,
        fixed={
            "dtype": "bf16",
            "micro_batch_size": 24,
            "checkpointing": "none",
            "tensor": 1,
            "pipeline": 1,
            "context": 1,  # as published: every rank holds whole sequences
            "offload": 0.0,
            "accumulation": "standard",
        },
        loop="forward_backward",
        top_k=1,
    )


def test_the_published_mpt_760m_configuration_fits_on_h100():
    with pytest.raises(InfeasibleError):
        _pinned(_mpt_760m())  # as the stand-in counted it before: refused
    best = _pinned(_mpt_760m(dropout=False, fused_loss=True)).candidates[0]
    assert best.memory.peak_gpu_bytes < load_hardware("h100-80gb-sxm").usable_memory_bytes
