"""Models written with unfused element-wise ops on rates fitted to fused ones (issue 23).

(1) a preset's rate already pays for the pointwise ops of the model it was fitted to
(``rate_pointwise_elems``): a traced model pays for the rest at ``pointwise_gbps``; (2) that
count and the read/write ratio behind the presets' ``pointwise_gbps`` are what transformers'
GPT-2 and MPT run (counted on the meta device); (3) a flat rate taken from fused-attention runs
prices an eager attention's score traffic, without the dropout a traced profile already counts.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest

from elixir_tune import paths
from elixir_tune.costmodel.model import CostModel
from elixir_tune.costmodel.rates import attention_scores_bytes, pointwise_beyond_rate
from elixir_tune.costmodel.synthetic import example_hardware, gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.hardware.presets import spec_problems

SIZES = {"hidden": 256, "layers": 4, "heads": 4, "vocab": 1024, "seq_len": 128}


def _traced(pointwise: float, recompute: float = 0.0, **sizes):
    """An analytic GPT-2 profile carrying the pointwise bytes a traced one would."""
    return dataclasses.replace(
        gpt2_profile(**{**SIZES, **sizes}),
        pointwise_bytes_per_sample=pointwise,
        recompute_pointwise_bytes_per_sample=recompute,
    )


def _flat_spec(**changes):
    spec = example_hardware()
    spec.model_tflops = {"bf16": 100.0}
    return dataclasses.replace(spec, **changes)


def test_only_the_pointwise_bytes_beyond_the_fitted_models_are_priced():
    # 15 elements x 2 bytes x 128 tokens x 4 layers x 256 hidden = 3,932,160 bytes already in the rate.
    included = 15 * 2 * 128 * 4 * 256
    profile = _traced(pointwise=4 * included, recompute=2 * included)
    spec = _flat_spec(pointwise_gbps=10.0, rate_pointwise_elems=15.0)
    assert pointwise_beyond_rate(profile, spec, "bf16") == pytest.approx(0.75)
    assert pointwise_beyond_rate(profile, spec, "fp32") == pytest.approx(0.5)  # 4-byte elements
    # A model with fewer pointwise ops than the fitted one pays nothing more, nor one without a count.
    assert pointwise_beyond_rate(_traced(pointwise=included / 2), spec, "bf16") == 0.0
    assert pointwise_beyond_rate(_traced(pointwise=0.0), spec, "bf16") == 0.0
    # A probed rate is net of all pointwise ops (the field is 0): every byte is priced.
    assert pointwise_beyond_rate(profile, dataclasses.replace(spec, rate_pointwise_elems=0.0), "bf16") == 1.0
    assert pointwise_beyond_rate(profile, dataclasses.replace(spec, pointwise_gbps=0.0), "bf16") == 0.0
    without = CostModel(profile, _flat_spec(), gpus_per_node=1, dtype="bf16")
    model = CostModel(profile, spec, gpus_per_node=1, dtype="bf16")
    extra = model.compute_s(2, 0)[0] - without.compute_s(2, 0)[0]
    assert extra == pytest.approx(2 * 0.75 * 4 * included / 10e9)
    # Every block recomputing: the same share of the recomputed forward's bytes.
    extra_recompute = model.compute_s(2, 1)[1] - without.compute_s(2, 1)[1]
    assert extra_recompute == pytest.approx(2 * 0.75 * 2 * included / 10e9)


def test_a_flat_rate_from_fused_attention_runs_prices_the_eager_scores():
    eager = gpt2_profile(**SIZES)
    fused = gpt2_profile(**SIZES, flash_attention=True)
    elements = 4 * 4 * 128**2
    spec = _flat_spec()
    # A flat rate from an eager attention (or not known to be fused) stands for the scores.
    assert CostModel(eager, spec, 1).compute_s(1, 0) == CostModel(fused, spec, 1).compute_s(1, 0)
    fused_rate = dataclasses.replace(spec, rate_fused_attention=True)
    hbm = spec.hbm_gbps * 1e9
    difference = CostModel(eager, fused_rate, 1).compute_s(1, 0)[0] - CostModel(fused, fused_rate, 1).compute_s(1, 0)[0]
    assert difference == pytest.approx(elements * (13 + 19) / hbm)
    # With a traced profile's pointwise bytes priced, its dropout leaves the scores' count: 4b and 7b.
    assert attention_scores_bytes(eager, "bf16", dropout_counted=True) == (elements * 8, elements * 14)
    traced = dataclasses.replace(eager, pointwise_bytes_per_sample=1e9)
    priced = dataclasses.replace(fused_rate, pointwise_gbps=100.0)
    assert CostModel(traced, priced, 1).scores_s_per_flop[1] == pytest.approx(
        elements * 14 / hbm / eager.flops_per_sample
    )


@pytest.mark.parametrize(
    "name", ["a100-40gb-pcie", "a100-40gb-sxm", "a100-80gb-pcie", "a100-80gb-sxm", "h100-80gb-sxm", "v100-32gb-sxm3"]
)
def test_gpu_presets_carry_a_sourced_pointwise_rate(name):
    spec = load_hardware(name)
    assert not spec_problems(spec)
    # hbm_gbps counts bytes read + written; a pointwise op reads 1.45 bytes per byte it writes.
    assert spec.pointwise_gbps == pytest.approx(spec.hbm_gbps / 2.45, abs=0.5)
    assert spec.rate_pointwise_elems == 15.0
    assert "pointwise_gbps" in spec.sources and "rate_pointwise_elems" in spec.sources
    # Scores are priced beside an attention rate or a flat rate from FlashAttention runs; V100's is Megatron's.
    assert (bool(spec.attention_tflops) or spec.rate_fused_attention) is (name != "v100-32gb-sxm3")


def test_the_preset_figures_are_what_transformers_models_run():
    """transformers' GPT-2 writes 89 pointwise elements per layer, token and hidden unit outside its
    scores and reads 1.45 bytes per byte written; MPT as llm-foundry runs it writes 15 (the presets'
    ``rate_pointwise_elems``). Counted on the meta device at a tiny shape: the figures do not depend on it."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(paths.REPO_DIR / "scripts"))
    from published_pointwise import count

    hidden, heads, seq = 64, 2, 32

    def per_layer(family: str, kind: str) -> tuple[float, float]:
        one, two = (count(family, hidden, heads, layers, seq) for layers in (1, 2))
        written = two.written[kind] - one.written[kind]
        return written / 2 / (seq * hidden), (two.read[kind] - one.read[kind]) / written

    gpt2_elems, gpt2_ratio = per_layer("gpt2", "other")
    assert gpt2_elems == pytest.approx(89.0)
    assert gpt2_ratio == pytest.approx(1.45, abs=0.01)
    assert per_layer("mpt", "other")[0] == pytest.approx(load_hardware("a100-80gb-sxm").rate_pointwise_elems)


def test_a_cpu_prices_the_math_path_of_an_attention_with_dropout():
    """(4) On a CPU device an attention with dropout runs torch's math path: each block's dropout score
    elements cost ``dropout_attention_s_per_score`` in forward+backward (a third again where the block
    recomputes); a GPU (its fused kernel takes the dropout) and a model without dropout pay nothing."""
    cpu = load_hardware("cpu")
    assert cpu.dropout_attention_s_per_score > 0 and "dropout_attention_s_per_score" in cpu.sources
    assert spec_problems(cpu) == []
    plain = gpt2_profile(**SIZES)
    scores = SIZES["heads"] * SIZES["seq_len"] ** 2
    dropout = dataclasses.replace(
        plain, blocks=[dataclasses.replace(b, dropout_scores_per_sample=scores) for b in plain.blocks]
    )
    extra_s = 2 * SIZES["layers"] * scores * cpu.dropout_attention_s_per_score
    for every, share in ((0, 0.0), (1, 1.0)):
        with_s = CostModel(dropout, cpu, gpus_per_node=1, dtype="fp32")._compute_s(2, every, 0.0)
        without_s = CostModel(plain, cpu, gpus_per_node=1, dtype="fp32")._compute_s(2, every, 0.0)
        assert with_s[0] - without_s[0] == pytest.approx(extra_s * (1 + share / 3))
        assert with_s[1] - without_s[1] == pytest.approx(extra_s * share / 3)
    gpu = example_hardware()
    assert CostModel(dropout, gpu, 1, dtype="bf16")._compute_s(2, 0, 0.0) == CostModel(
        plain, gpu, 1, dtype="bf16"
    )._compute_s(2, 0, 0.0)
