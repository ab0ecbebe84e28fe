"""Offloading frozen chunks (a LoRA base) against trainable ones: the cost model prices a frozen shard's
offload as uploads only (no gradient copied down, no host Adam, in the step and in its bounds) and frees
its compute-dtype bytes only; the search offloads whichever shards cover the device's need at the least
time (costmodel/offload.py); a model without frozen chunks keeps its one order, by fetches."""

from __future__ import annotations

import pytest
import torch

from elixir_tune.costmodel.memory import SHARD_BYTES
from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.costmodel.rates import plausibility_bound
from elixir_tune.hardware import load_hardware
from elixir_tune.profiler import profile_model
from elixir_tune.search import InfeasibleError, search

LORA = dict(rank=4, alpha=8.0, dropout=0.0, target_modules="q_proj,v_proj")
CHUNK = 1 << 20  # one frozen chunk (the base) and one trainable chunk (the adapters)
GPUS = 2
BF16_BYTES = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    directory = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def lora_profile(model_dir):
    return profile_model(model_dir, batch_size=2, seq_len=16, lora=LORA, dtype="bf16")


@pytest.fixture(scope="module")
def hardware():
    return load_hardware("a100-80gb-sxm")


def chunks_by_kind(model: CostModel) -> tuple[int, int]:
    layout = model.layout(CHUNK)
    frozen = [c for c, chunk in enumerate(layout.chunks) if chunk.frozen]
    trainable = [c for c, chunk in enumerate(layout.chunks) if not chunk.frozen]
    assert len(frozen) == 1 and len(trainable) == 1
    return frozen[0], trainable[0]


def shape(model: CostModel, offloaded: tuple[int, ...]) -> Shape:
    cache = model.min_cache_blocks(CHUNK, 0)
    return Shape(CHUNK, cache, len(offloaded), 0, 0, 2, 1, offloaded=offloaded)


def test_an_offloaded_frozen_shard_pays_uploads_only(lora_profile, hardware):
    model = CostModel(lora_profile, hardware, gpus_per_node=GPUS)
    frozen, trainable = chunks_by_kind(model)
    shard_numel = CHUNK // GPUS
    none, only_frozen, only_trainable = (shape(model, ids) for ids in ((), (frozen,), (trainable,)))
    step = {ids: model.step_time(s).breakdown for ids, s in (("frozen", only_frozen), ("trainable", only_trainable))}
    # Frozen: its weights come up at each fetch; no gradient goes down and Adam has nothing to step on the host.
    assert step["frozen"]["h2d_s"] > 0
    assert not step["frozen"].get("d2h_s") and not step["frozen"].get("optimizer_cpu_s")
    assert not step["frozen"].get("bound_cpu_adam_s")
    up_s = shard_numel * BF16_BYTES / (hardware.h2d_gbps_all * 1e9)
    assert step["frozen"]["bound_pcie_s"] == pytest.approx(up_s)
    # Trainable: its gradient goes down and the host steps Adam over it.
    assert step["trainable"]["d2h_s"] > 0 and step["trainable"]["optimizer_cpu_s"] > 0
    assert step["trainable"]["bound_cpu_adam_s"] > 0
    assert model.step_time(only_frozen).step_time_s < model.step_time(only_trainable).step_time_s
    # Device bytes freed: the compute-dtype weights for frozen, master + gradient + Adam for trainable.
    base = model.memory(none).required_gpu_bytes
    assert base - model.memory(only_frozen).required_gpu_bytes == shard_numel * BF16_BYTES
    assert base - model.memory(only_trainable).required_gpu_bytes == shard_numel * SHARD_BYTES


def test_the_bounds_count_host_adam_and_gradients_down_for_trainable_shards_only(hardware):
    offloaded = 1 << 20
    full = plausibility_bound(hardware, "bf16", 0.0, offloaded, GPUS, GPUS)
    frozen = plausibility_bound(hardware, "bf16", 0.0, offloaded, GPUS, GPUS, offloaded_trainable_numel_per_rank=0)
    assert full["bound_cpu_adam_s"] > 0 and frozen["bound_cpu_adam_s"] == 0
    assert frozen["bound_pcie_s"] == pytest.approx(offloaded * BF16_BYTES / (hardware.h2d_gbps_all * 1e9))
    assert full["bound_pcie_s"] >= frozen["bound_pcie_s"]


def test_the_search_offloads_the_cheapest_shards_that_cover_the_need(lora_profile, hardware):
    model = CostModel(lora_profile, hardware, gpus_per_node=GPUS)
    frozen, trainable = chunks_by_kind(model)
    cache = model.min_cache_blocks(CHUNK, 0)
    fixed = {"chunk_size": CHUNK, "checkpointing": "none", "micro_batch_size": 2, "cache_blocks": cache, "prefetch": 0}
    base = model.memory(shape(model, ())).required_gpu_bytes
    frees_frozen = base - model.memory(shape(model, (frozen,))).required_gpu_bytes
    step_s = {
        ids: model.step_time(shape(model, ids)).step_time_s for ids in ((frozen,), (trainable,), (frozen, trainable))
    }
    assert step_s[(frozen,)] < step_s[(trainable,)] < step_s[(frozen, trainable)]
    # A need the frozen shard covers: it goes (uploads only), though the trainable one frees more per second.
    # A need only the trainable shard covers alone: it goes, not both.
    for need_bytes, expected in ((1, (frozen,)), (frees_frozen + 1, (trainable,))):
        result = search(
            lora_profile, hardware, GPUS, global_batch_size=4, fixed=fixed, device_memory_bytes=base - need_bytes
        )
        offloaded = tuple(chunk.id for chunk in result.plan.memory.chunks if chunk.offload)
        assert offloaded == expected, need_bytes
        assert result.plan.prediction.step_time_s == pytest.approx(step_s[expected], rel=1e-3)


def test_a_model_without_frozen_chunks_keeps_one_order_by_fetches(model_dir, hardware):
    model = CostModel(profile_model(model_dir, batch_size=2, seq_len=16, dtype="bf16"), hardware, gpus_per_node=GPUS)
    chunk_size = 4096
    cache = model.min_cache_blocks(chunk_size, 0)
    sim, cold = model.cache_sim(chunk_size, 0, cache)
    fetches = [0] * model.layout(chunk_size).num_chunks
    for _step, chunk, _free in cold + sim.steady:
        fetches[chunk] += 1
    orders = model.offload_orders(chunk_size, 0, cache)
    assert orders == [sorted(range(len(fetches)), key=lambda c: (fetches[c], -c))]


def test_nothing_fits_names_what_offloading_the_frozen_base_really_frees(lora_profile, hardware):
    """The "nothing fits" error's figure: the device need with every shard offloaded, where the frozen
    base's shard frees its bf16 weights only (not a trainable shard's master, gradient and Adam)."""
    model = CostModel(lora_profile, hardware, gpus_per_node=GPUS)
    frozen, trainable = chunks_by_kind(model)
    cache = model.min_cache_blocks(CHUNK, 0)
    fixed = {
        "chunk_size": CHUNK,
        "checkpointing": "none",
        "micro_batch_size": 2,
        "cache_blocks": cache,
        "prefetch": 0,
        "pipeline": 1,
        "tensor": 1,
        "context": 1,  # this layout's figure (a context split would need less)
    }
    with pytest.raises(InfeasibleError) as caught:
        search(lora_profile, hardware, GPUS, global_batch_size=4, fixed=fixed, device_memory_bytes=1 << 20)
    all_offloaded = model.memory(shape(model, (frozen, trainable))).required_gpu_bytes
    base = model.memory(shape(model, ())).required_gpu_bytes
    shard_numel = CHUNK // GPUS
    assert base - all_offloaded == shard_numel * (BF16_BYTES + SHARD_BYTES)
    assert caught.value.required_gpu_bytes == all_offloaded
    assert f"{all_offloaded / 2**30:.2f} GiB" in str(caught.value)
