"""The profiler: parameters, access trace, blocks, FLOPs, model sources and their errors."""

from pathlib import Path

import pytest
import torch

from elixir_tune.paths import MODEL_CONFIGS_DIR
from elixir_tune.plan.fingerprint import fingerprint
from elixir_tune.profiler import (
    ModelSourceError,
    load_model_source,
    load_profile,
    profile_model,
    save_profile,
)

MODELS = Path(__file__).parent / "models"
TINY_MLP = str(MODELS / "tiny_mlp.py")


@pytest.fixture(scope="module")
def tiny():
    return profile_model("gpt2-tiny", batch_size=4, seq_len=64, checkpointing="all")


def test_gpt2_124m_exact_parameters_tied_embedding_and_flops():
    profile = profile_model("gpt2-124m", batch_size=1, seq_len=1024)
    assert profile.num_params == 124_439_808
    assert [p.name for p in profile.params if p.shared] == ["transformer.wte.weight"]
    assert len(profile.params) == len({p.name for p in profile.params})  # the tied weight is listed once
    assert profile.block_list == "transformer.h" and len(profile.blocks) == 12
    # Analytic: 6 x params per token, plus attention scores and weighted sum (2 matmuls of
    # 2*s*d FLOPs per token and layer, forward; backward twice that).
    layers, width, seq = 12, 768, 1024
    analytic_per_token = 6 * profile.num_params + 3 * 2 * 2 * seq * width * layers
    assert profile.flops_per_token == pytest.approx(analytic_per_token, rel=0.02)
    # Recomputing every block once costs one more forward of the blocks.
    blocks_fwd = sum(b.fwd_flops_per_sample for b in profile.blocks)
    assert profile.recompute_flops_per_sample == pytest.approx(blocks_fwd, rel=1e-6)


def test_params_in_first_use_order_and_trace_indices(tiny):
    names = [p.name for p in tiny.params]
    assert names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    forward = tiny.trace[: len(tiny.trace) // 2]
    backward = tiny.trace[len(tiny.trace) // 2 :]
    first_seen = []
    for step in forward:
        first_seen += [i for i in step if i not in first_seen]
    assert first_seen == list(range(len(tiny.params)))  # first-use order is the params order
    assert forward[0] == [0] and forward[-1] == [0]  # wte, then lm_head: the same tied index
    assert backward == forward[::-1]  # without checkpointing, backward mirrors forward
    assert all(step for step in tiny.trace)


def test_blocks_own_contiguous_param_ranges(tiny):
    assert tiny.block_list == "transformer.h" and len(tiny.blocks) == 2
    for block in tiny.blocks:
        owned = tiny.params[block.first_param : block.first_param + block.num_params]
        assert {p.name.split(".")[2] for p in owned} == {str(block.index)}
        assert all(p.name.startswith(f"transformer.h.{block.index}.") for p in owned)
        assert block.num_params == 12
        assert block.fwd_flops_per_sample > 0
        assert block.boundary_bytes_per_sample == 64 * 64 * 4  # seq x width x fp32
        assert block.activation_bytes_per_sample > block.boundary_bytes_per_sample


def test_checkpointed_trace_recomputes_each_block_before_its_backward(tiny):
    plain, ckpt = tiny.trace, tiny.trace_checkpointed
    half = len(plain) // 2
    assert ckpt[:half] == plain[:half]
    block_steps = {}
    for block in tiny.blocks:
        owned = set(range(block.first_param, block.first_param + block.num_params))
        block_steps[block.index] = [s for s in plain[:half] if set(s) <= owned]
    expected = plain[half : half + 2]  # lm_head, ln_f backward
    for index in reversed(range(len(tiny.blocks))):
        expected += block_steps[index] + block_steps[index][::-1]
    expected += plain[-2:]  # wpe, wte backward
    assert ckpt[half:] == expected
    assert tiny.recompute_flops_per_sample > 0
    assert tiny.activation_checkpointed.per_sample_bytes < tiny.activation.per_sample_bytes


def test_trace_checkpointed_only_when_asked():
    profile = profile_model("gpt2-tiny", batch_size=2, seq_len=32)
    assert profile.trace_checkpointed == []
    assert profile.activation_checkpointed is not None  # the search still needs it


def test_fingerprint_matches_the_model_as_built(tiny):
    torch.manual_seed(0)
    model = load_model_source("gpt2-tiny").build_model()
    assert next(model.parameters()).device.type == "cpu"
    expected = fingerprint(
        [(n, list(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters()]
    )
    assert tiny.fingerprint == expected
    assert profile_model("gpt2-tiny", batch_size=2, seq_len=32, dtype="bf16").fingerprint == expected


def test_bf16_halves_activations_and_keeps_built_dtype(tiny):
    bf16 = profile_model("gpt2-tiny", batch_size=4, seq_len=64, dtype="bf16")
    assert bf16.dtype == "bf16" and {p.dtype for p in bf16.params} == {"fp32"}
    assert bf16.blocks[0].boundary_bytes_per_sample == tiny.blocks[0].boundary_bytes_per_sample // 2
    assert bf16.activation.per_sample_bytes < 0.75 * tiny.activation.per_sample_bytes


def test_python_model_file_with_tied_head_and_other_builder():
    profile = profile_model(TINY_MLP, batch_size=2, seq_len=8)
    assert profile.name == "tiny_mlp" and profile.block_list == "blocks" and len(profile.blocks) == 3
    assert [p.name for p in profile.params if p.shared] == ["embed.weight"]
    assert profile.trace[0] == [0] and profile.trace[-1] == [0]
    assert profile.buffers_bytes == 16 * 4
    deep = profile_model(f"{TINY_MLP}:build_deep", batch_size=2, seq_len=8)
    assert len(deep.blocks) == 5 and deep.source.endswith(":build_deep")


def test_llama_grouped_query_attention_profiles():
    profile = profile_model(str(MODELS / "llama-tiny.yaml"), batch_size=2, checkpointing="all")
    assert profile.seq_len == 64 and profile.block_list == "model.layers"
    assert len(profile.trace_checkpointed) > len(profile.trace)


def test_save_and_load_round_trip(tiny, tmp_path):
    path = tmp_path / "profile.yaml"
    save_profile(tiny, path)
    assert path.read_text().startswith("# gpt2-tiny: 124,672 parameters")
    assert load_profile(path) == tiny


def test_yaml_source_batches_and_defaults():
    source = load_model_source("gpt2-tiny")
    assert source.name == "gpt2-tiny" and source.default_seq_len == 128 and source.vocab_size == 256
    batch = source.example_batch(3, 16)
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (3, 16)
    assert int(batch["input_ids"].max()) < 256
    assert load_model_source(str(MODEL_CONFIGS_DIR / "gpt2-tiny.yaml")).name == "gpt2-tiny"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("does/not/exist.py", "no such file"),
        ("no-such-config", "no config named 'no-such-config'"),
        (str(MODELS / "no_builder.py"), "no builder function build_model()"),
        (f"{TINY_MLP}:build_wide", "no builder function build_wide()"),
        (str(MODELS / "bad_arch.yaml"), "unknown architecture 'gpt9000'"),
    ],
)
def test_load_errors(spec, message):
    with pytest.raises(ModelSourceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model_source(spec)


def test_builder_raising_shows_its_message():
    with pytest.raises(ModelSourceError, match="build_model\\(\\) raised ValueError: width 7 is not divisible"):
        profile_model(str(MODELS / "raising_builder.py"), batch_size=1, seq_len=4)


def test_forward_without_loss_is_refused():
    with pytest.raises(ModelSourceError, match="did not return a loss"):
        profile_model(str(MODELS / "no_loss.py"), batch_size=1, seq_len=4)


def test_seq_len_beyond_the_positions_is_refused():
    with pytest.raises(ModelSourceError, match="seq_len 256 is longer than the model's 128 positions"):
        profile_model("gpt2-tiny", batch_size=1, seq_len=256)


def test_unsupported_dtype_is_refused():
    with pytest.raises(ModelSourceError, match="unsupported dtype 'int8'"):
        profile_model("gpt2-tiny", dtype="int8")
