"""Activation bytes per token at the published rows' shapes: the profile against a real bf16 forward on the CPU.

The published Llama and MPT/GPT-2 rows run at widths of 4096-8192; their bytes kept per token and hidden unit
depend on the shape's ratios (FFN width over hidden, head size), not on the width, once attention is a fused
kernel (no seq x seq scores). So each family is built here at width 256 with its published ratios: Llama-2
13B's (FFN 2.7 x hidden, head size 128, scaled 1/20 in width), MPT's (a GPT-2 of FFN 4 x hidden, head size
128, no dropout: the stand-in ``gpt2_profile`` the llm-foundry rows use, scaled 1/16 from MPT-7B), seq 128,
bf16, and its blocks' forward counted with ``saved_bytes`` (test_profiler_activations.py). torchtitan's fused
norm (scripts/published_peer_models.py) is checked the same way.
"""

from __future__ import annotations

import sys

import pytest
import torch

from elixir_tune import paths
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.profiler import profile_model
from elixir_tune.profiler.source import ModelSource
from tests.unit.test_profiler_activations import saved_bytes

HIDDEN = 256
HEADS = 2  # head size 128, as the published rows
LAYERS = 2
SEQ = 128
VOCAB = 1000
TOLERANCE = 0.05

sys.path.insert(0, str(paths.REPO_DIR / "scripts"))
from published_peer_models import fuse_norms  # noqa: E402 - scripts/ is not a package


def _llama(fused: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=int(HIDDEN * 13824 / 5120),
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        use_cache=False,
    )
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    return fuse_norms(model) if fused else model


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=HIDDEN,
        n_head=HEADS,
        n_layer=LAYERS,
        vocab_size=VOCAB,
        n_positions=SEQ,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        activation_function="gelu",
    )
    return GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")


def _batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _real_bytes_per_token_hidden(build) -> float:
    """What the blocks' real bf16 forward saves, per token and hidden unit per block (batch 2 minus batch 1)."""
    torch.manual_seed(0)
    model = build().to(torch.bfloat16).train()
    _, one = saved_bytes(model, _batch(1, SEQ))
    _, two = saved_bytes(model, _batch(2, SEQ))
    return (two - one) / (LAYERS * SEQ * HIDDEN)


def _profiled(build) -> float:
    source = ModelSource(name="m", source="m", vocab_size=VOCAB, max_seq_len=SEQ, _build=build, _batch=_batch)
    profile = profile_model(source, batch_size=1, seq_len=SEQ, dtype="bf16")
    return sum(block.activation_bytes_per_sample for block in profile.blocks) / (LAYERS * SEQ * HIDDEN)


@pytest.mark.parametrize("fused", [False, True], ids=["transformers-norm", "torchtitan-fused-norm"])
def test_llama_bytes_per_token_match_a_real_bf16_forward(fused: bool):
    real = _real_bytes_per_token_hidden(lambda: _llama(fused))
    profiled = _profiled(lambda: _llama(fused))
    print(f"llama fused={fused}: real {real:.2f}, profiled {profiled:.2f} B/token/hidden/block")
    assert abs(profiled / real - 1) <= TOLERANCE, (real, profiled)


def test_fused_norm_saves_eight_bytes_per_token_less():
    """Each norm of a block keeps 4 + 2 bytes (fp32 copy, bf16 normalized) in transformers where the fused
    norm keeps its 2-byte bf16 input: 8 bytes per token and hidden unit less per block."""
    saved = _real_bytes_per_token_hidden(lambda: _llama(False)) - _real_bytes_per_token_hidden(lambda: _llama(True))
    assert saved == pytest.approx(8.0, abs=0.1), saved


def test_fused_norm_equals_transformers_norm_in_fp32():
    """The fused norm computes what transformers' ``LlamaRMSNorm`` does: output and gradients in fp32."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    reference = LlamaRMSNorm(64, eps=1e-5)
    reference.weight.data.uniform_(0.5, 1.5)
    fused = fuse_norms(torch.nn.Sequential(LlamaRMSNorm(64, eps=1e-5)))
    fused[0].weight.data.copy_(reference.weight.data)
    x = torch.randn(3, 5, 64, dtype=torch.float64).float()
    x_ref, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(3, 5, 64)
    reference(x_ref).backward(grad)
    out = fused(x_fused)
    out.backward(grad)
    torch.testing.assert_close(out, reference(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x_fused.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused[0].weight.grad, reference.weight.grad, rtol=1e-5, atol=1e-5)


def test_mpt_stand_in_bytes_per_token_match_a_real_bf16_forward():
    real = _real_bytes_per_token_hidden(_gpt2)
    profile = gpt2_profile(
        "mpt-scaled",
        hidden=HIDDEN,
        layers=LAYERS,
        heads=HEADS,
        vocab=VOCAB,
        positions=SEQ,
        seq_len=SEQ,
        dtype="bf16",
        flash_attention=True,
        dropout=False,
        fused_loss=True,
    )
    profiled = sum(block.activation_bytes_per_sample for block in profile.blocks) / (LAYERS * SEQ * HIDDEN)
    print(f"mpt stand-in: real {real:.2f}, profiled {profiled:.2f} B/token/hidden/block")
    assert abs(profiled / real - 1) <= TOLERANCE, (real, profiled)
