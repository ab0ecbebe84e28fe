"""The profiler on families beyond GPT-style LMs, and its errors on models it cannot trace."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from elixir_tune.profiler import ModelSourceError, profile_model

MODELS = Path(__file__).parent / "models"
FAMILIES = MODELS / "families.py"


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _real_flops_per_sample(model: torch.nn.Module, batch: dict) -> float:
    """FLOPs of one real forward+backward on the CPU, per sample."""
    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    return counter.get_total_flops() / len(next(iter(batch.values())))


@pytest.mark.parametrize("builder", ["build_t5", "build_bart"])
def test_encoder_decoder_profiles_with_every_block_checkpointed(builder):
    # T5's decoder fills a key/value cache in forward; left on, its recomputation differs.
    profile = profile_model(f"{FAMILIES}:{builder}", batch_size=2, seq_len=16, checkpointing="all")
    assert profile.block_list.endswith(".block") or profile.block_list.endswith(".layers")
    assert len(profile.trace_checkpointed) > len(profile.trace)
    assert profile.activation_checkpointed.per_sample_bytes < profile.activation.per_sample_bytes


def test_fused_experts_profile_with_the_flops_of_their_routed_tokens():
    families = _module(FAMILIES)
    profile = profile_model(f"{FAMILIES}:build_moe", batch_size=2, seq_len=16)
    torch.manual_seed(0)
    model = families.build_moe().train()
    assert profile.num_params == sum(p.numel() for p in model.parameters())
    # Eager experts run each routed token through its expert as a plain matmul, which the counter
    # counts: the profile (grouped matmuls on meta) must count the same work. Attention kernels are
    # counted a little differently (about 6% on the families here), hence the band.
    model.set_experts_implementation("eager")
    real = _real_flops_per_sample(model, families.example_batch(2, 16))
    assert 0.97 * real < profile.flops_per_sample < 1.15 * real


def test_vision_transformer_takes_pixel_values():
    profile = profile_model(str(MODELS / "vit_tiny.py"), batch_size=2, seq_len=1)
    assert profile.block_list == "vit.layers" and len(profile.blocks) == 2
    vit = _module(MODELS / "vit_tiny.py")
    torch.manual_seed(0)
    real = _real_flops_per_sample(vit.build_model().train(), vit.example_batch(2, 1))
    assert 0.97 * real < profile.flops_per_sample < 1.15 * real


def test_value_reading_model_is_refused_with_the_module_that_did_it():
    with pytest.raises(ModelSourceError) as error:
        profile_model(str(MODELS / "data_dependent.py"), batch_size=2, seq_len=1)
    message = str(error.value)
    assert "the forward of router (Router)" in message
    assert "meta device" in message and "Traceback" not in message
