"""Frozen chunks and LoRA on the library side: names, plan fields and their checks, the fingerprint,
and a LoRA profile searched into a plan whose frozen chunks carry weights only."""

from __future__ import annotations

import copy

import pytest
import torch
from click.testing import CliRunner

from elixir_tune.cli.main import cli
from elixir_tune.costmodel.model import CostModel
from elixir_tune.engine.setup import check_plan_matches
from elixir_tune.hardware import load_hardware
from elixir_tune.models.lora import LoraError, adapter_init, apply_lora, lora_settings
from elixir_tune.models.lora_layout import base_name, is_adapter_name
from elixir_tune.plan import fingerprint, load_plan, model_fingerprint, plan_from_dict, save_plan, validate
from elixir_tune.plan.schema import DTYPE_BYTES, SHARD_BYTES_PER_ELEMENT
from elixir_tune.profiler import profile_model
from elixir_tune.search import search

LORA = dict(rank=4, alpha=8.0, dropout=0.0, target_modules="q_proj,v_proj")


def test_peft_names_map_back_to_the_checkpoint_and_adapters_are_known():
    assert base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert base_name("base_model.model.lm_head.weight") == "lm_head.weight"
    assert base_name("model.norm.weight") == "model.norm.weight"
    assert is_adapter_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    assert not is_adapter_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")


def test_adapter_init_is_pefts_start_from_the_seed_and_name_alone():
    name_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    first = adapter_init(name_a, (4, 64), seed=3)
    assert torch.equal(first, adapter_init(name_a, (4, 64), seed=3))
    assert not torch.equal(first, adapter_init(name_a, (4, 64), seed=4))
    assert not torch.equal(first, adapter_init(name_a.replace("q_proj", "v_proj"), (4, 64), seed=3))
    assert float(first.abs().max()) <= 1 / 64**0.5 and float(first.std()) > 0.01  # kaiming(a=sqrt(5)) bound
    assert float(adapter_init(name_a.replace("lora_A", "lora_B"), (64, 4), seed=3).abs().max()) == 0.0


def test_apply_lora_freezes_the_base_and_bad_settings_say_what_is_wrong(tiny_llama):
    model = apply_lora(tiny_llama(), **LORA)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(is_adapter_name(n) for n in trained)
    assert lora_settings(model) == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    assert lora_settings(tiny_llama()) == {}
    with pytest.raises(LoraError, match="rank must be a positive integer"):
        apply_lora(tiny_llama(), rank=0)
    with pytest.raises(LoraError, match="dropout"):
        apply_lora(tiny_llama(), rank=2, dropout=1.0)
    with pytest.raises(LoraError, match="cannot adapt"):
        apply_lora(tiny_llama(), rank=2, target_modules="no_such_proj")


def test_the_fingerprint_marks_frozen_parameters_and_keeps_full_models_as_before():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4))
    before = fingerprint([("0.weight", [4, 3], "float32"), ("0.bias", [4], "float32")])
    assert model_fingerprint(model) == before
    model[0].bias.requires_grad_(False)
    assert model_fingerprint(model) != before


@pytest.fixture(scope="module")
def tiny_llama():
    import transformers

    transformers.logging.set_verbosity_error()

    def build():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=32,
                tie_word_embeddings=False,
            )
        )

    return build


@pytest.fixture(scope="module")
def lora_profile(tmp_path_factory, tiny_llama):
    directory = tmp_path_factory.mktemp("llama")
    tiny_llama().save_pretrained(directory)
    return profile_model(str(directory), batch_size=2, seq_len=16, lora=LORA), str(directory)


@pytest.fixture(scope="module")
def lora_plan(lora_profile):
    profile, _ = lora_profile
    hardware = load_hardware("cpu")
    fixed = {"chunk_size": 2048, "offload": 0.5, "cache_blocks": 2, "checkpointing": "none", "micro_batch_size": 2}
    return search(profile, hardware, gpus_per_node=2, global_batch_size=4, fixed=fixed)


def test_a_lora_profile_sees_a_frozen_base_and_records_the_settings(lora_profile):
    profile, _ = lora_profile
    frozen = [p for p in profile.params if not p.requires_grad]
    trained = [p for p in profile.params if p.requires_grad]
    assert frozen and trained and all(is_adapter_name(p.name) for p in trained)
    assert profile.lora == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    # Pipeline stages and 1d tensor parallelism run a LoRA model: its tensor table places the LoRA
    # layers' parts (elixir_tune/models/lora_layout.py).
    assert not profile.layout_reasons()
    table = profile.arch.tensor_layout
    layer = "base_model.model.model.layers.*.self_attn.q_proj"
    assert table[layer] == "lora_colwise" and table[f"{layer}.base_layer"] == table[f"{layer}.lora_B.*"] == "colwise"
    assert table[f"{layer}.lora_A.*"] == "replicated_linear"
    assert table["base_model.model.model.layers.*.self_attn.o_proj"] == "rowwise"


def test_the_search_puts_the_base_in_frozen_chunks_counted_at_the_compute_dtype(lora_profile, lora_plan):
    profile, _ = lora_profile
    plan = lora_plan.plan
    assert not validate(plan)
    assert plan.model.lora == profile.lora and plan.model.fingerprint == profile.fingerprint
    frozen_names = {p.name for p in profile.params if not p.requires_grad}
    for chunk in plan.memory.chunks:
        assert set(chunk.params) <= frozen_names if chunk.frozen else not set(chunk.params) & frozen_names
    frozen = [c for c in plan.memory.chunks if c.frozen]
    trained = [c for c in plan.memory.chunks if not c.frozen]
    assert len(frozen) >= 2 and trained
    # Model states: trainable shards at Adam's 16 bytes per element, frozen ones at 4 (fp32) only.
    shard = plan.memory.chunk_size // 2
    expected = {False: 0, True: 0}
    for chunk in plan.memory.chunks:
        per_element = DTYPE_BYTES["fp32"] if chunk.frozen else SHARD_BYTES_PER_ELEMENT["adam"]
        expected[chunk.offload] += shard * per_element
    states = plan.prediction.model_state_bytes
    assert (states["device_shard_bytes"], states["host_shard_bytes"]) == (expected[False], expected[True])
    # The same model fully fine-tuned would pay 16 bytes per element for every chunk.
    full = CostModel(profile, load_hardware("cpu"), gpus_per_node=2)
    layout = full.layout(plan.memory.chunk_size)
    assert layout.num_frozen == len(frozen)


def test_plan_fields_round_trip_and_their_checks(lora_plan):
    raw = lora_plan.plan.to_dict()
    assert any(chunk.get("frozen") for chunk in raw["memory"]["chunks"])
    assert all("frozen" not in chunk for chunk in raw["memory"]["chunks"] if not chunk.get("frozen", False))
    assert plan_from_dict(raw).memory.chunks == lora_plan.plan.memory.chunks
    bad = copy.deepcopy(raw)
    bad["model"]["lora"]["rank"] = 0
    bad["model"]["lora"]["target_modules"] = []
    problems = validate(bad)
    assert any("model.lora.rank" in p for p in problems) and any("model.lora.target_modules" in p for p in problems)
    unfrozen = copy.deepcopy(raw)
    for chunk in unfrozen["memory"]["chunks"]:
        chunk.pop("frozen", None)
    assert any("no chunk is frozen" in p for p in validate(unfrozen))
    both = copy.deepcopy(raw)
    both["parallel"] = {"pipeline": {"stages": 2}, "tensor": {"degree": 2}}
    assert not any("frozen chunks (a LoRA base)" in p for p in validate(both))  # pipeline x 1d tensor runs them
    grid = copy.deepcopy(raw)
    grid["parallel"] = {"tensor": {"degree": 4, "mode": "2d"}}
    assert any("frozen chunks (a LoRA base) run with 1d tensor parallelism" in p for p in validate(grid))


@pytest.mark.parametrize("pins", [{"pipeline": 2, "tensor": 1}, {"tensor": 2, "pipeline": 1}])
def test_the_search_makes_valid_lora_plans_on_stages_and_tensor_pieces(lora_profile, pins):
    profile, _ = lora_profile
    fixed = {"chunk_size": 2048, "checkpointing": "none", "micro_batch_size": 2, **pins}
    result = search(
        profile, load_hardware("cpu"), gpus_per_node=2, global_batch_size=4, fixed=fixed, loop="forward_backward"
    )
    plan = result.plan
    assert not validate(plan)
    assert (plan.parallel.pipeline.stages, plan.parallel.tensor.degree) == (pins["pipeline"], pins["tensor"])
    frozen = [chunk for chunk in plan.memory.chunks if chunk.frozen]
    assert {chunk.stage for chunk in frozen} == set(range(pins["pipeline"]))
    if pins["tensor"] > 1:  # the frozen chunks hold each rank's local pieces: half of q_proj's base
        q_proj = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
        assert plan.model.tensor_layout and any(q_proj in chunk.params for chunk in frozen)


def test_the_search_makes_valid_lora_plans_on_stages_of_tensor_pieces(lora_profile):
    profile, _ = lora_profile
    fixed = {"pipeline": 2, "tensor": 2, "chunk_size": 2048, "checkpointing": "none", "micro_batch_size": 2}
    plan = search(
        profile, load_hardware("cpu"), gpus_per_node=4, global_batch_size=4, fixed=fixed, loop="forward_backward"
    ).plan
    assert not validate(plan)
    assert (plan.parallel.pipeline.stages, plan.parallel.tensor.degree, plan.parallel.tensor.mode) == (2, 2, "1d")
    frozen = [chunk for chunk in plan.memory.chunks if chunk.frozen]
    assert {chunk.stage for chunk in frozen} == {0, 1}
    q_proj = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert plan.model.tensor_layout and any(q_proj in chunk.params for chunk in frozen)


def test_setup_refuses_a_model_whose_adapters_or_frozen_parameters_differ_from_the_plan(
    lora_plan, lora_profile, tiny_llama, tmp_path
):
    save_plan(lora_plan.plan, tmp_path / "plan.yaml")
    plan = load_plan(tmp_path / "plan.yaml")  # through YAML, as elixir-run hands it over
    with torch.device("meta"):
        model = apply_lora(tiny_llama(), **LORA)
    check_plan_matches(model, plan)  # the model the plan was searched for
    other_alpha = copy.deepcopy(plan)
    other_alpha.model.lora["alpha"] = 16.0
    with pytest.raises(ValueError, match="LoRA adapters .* differ from the plan's model.lora"):
        check_plan_matches(model, other_alpha)
    moved = copy.deepcopy(plan)
    frozen_chunk = next(c for c in moved.memory.chunks if c.frozen)
    trained_chunk = next(c for c in moved.memory.chunks if not c.frozen)
    frozen_chunk.frozen, trained_chunk.frozen = False, True
    with pytest.raises(ValueError, match="trainable parameters in frozen chunks"):
        check_plan_matches(model, moved)
    with torch.device("meta"):
        full = tiny_llama()
    with pytest.raises(ValueError, match="another model"):
        check_plan_matches(full, plan)


def test_profile_command_takes_lora_options(lora_profile, tmp_path):
    _, directory = lora_profile
    runner = CliRunner()
    out = tmp_path / "p.yaml"
    result = runner.invoke(
        cli, ["profile", directory, "-b", "1", "-s", "8", "--lora-rank", "2", "-o", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert '"rank": 2' in result.output and out.is_file()
    result = runner.invoke(cli, ["profile", directory, "--lora-alpha", "4"])
    assert result.exit_code != 0 and "need --lora-rank" in result.output


def test_lora_tensor_tables_refuse_what_the_engine_does_not_split(tiny_llama):
    import transformers
    from peft import LoraConfig, get_peft_model

    from elixir_tune.models.stage_plans import resolve_stage_plan
    from elixir_tune.models.tensor_table import model_tensor_table

    table, why = model_tensor_table(apply_lora(tiny_llama(), rank=2, target_modules="down_proj"))
    assert not why and table["base_model.model.model.layers.*.mlp.down_proj.lora_A.*"] == "rowwise_partial"
    assert table["base_model.model.model.layers.*.mlp.down_proj"] == "lora_rowwise"
    # The output head is split by vocabulary: LoRA on it is not run under tensor parallelism.
    table, why = model_tensor_table(apply_lora(tiny_llama(), rank=2, target_modules="lm_head"))
    assert not table and "LoRA on base_model.model.lm_head, a 'vocab' module" in why
    # Adapters on some blocks only would need two kinds of entries under one pattern.
    some = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"], layers_to_transform=[0]))
    table, why = model_tensor_table(some)
    assert not table and "adapt the same modules in every block" in why
    # GPT-2's split is hand-written engine code (Conv1D), not its table: not run with LoRA.
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64))
    table, why = model_tensor_table(apply_lora(gpt2, rank=2, target_modules="c_attn"))
    assert not table and "gpt2 has none" in why
    # A PEFT model's stage plan is its causal LM's, under PEFT's path to it.
    plan = resolve_stage_plan(apply_lora(tiny_llama(), **LORA))
    assert not isinstance(plan, str) and plan.block_list == "base_model.model.model.layers"
