"""LoRA through PEFT on the chunk engine, at world 2 (gloo, CPU), in one launch (lora_worker.py).

* 10 AdamW steps of a tiny Llama (hidden 64, 2 layers) with LoRA adapters, its frozen base in frozen
  chunks sharded over the two ranks and some chunks (frozen ones among them) offloaded, equal plain
  PEFT on one process over the same global batches: loss 1e-5 relative, adapter weights 1e-5
  absolute, base weights bitwise unchanged; a frozen chunk holds its compute-dtype shard only.
* The adapter ``save_adapter`` wrote loads with ``PeftModel.from_pretrained`` and gives the trained
  model's logits; the ``save_merged`` directory loads with plain ``AutoModelForCausalLM`` (no
  adapters left) and gives them too.
* ``setup(weights=DIR)`` reads a Hugging Face directory into the base of a LoRA model built on the
  meta device; the adapters start as PEFT starts them (``adapter_init``).

A second launch (world 2) runs LoRA under a 2-stage pipeline plan and under 1d tensor plans (tensor 2,
with and without sequence parallelism): 3 AdamW steps of ``forward_backward`` equal plain PEFT on the
step's batch (loss 1e-5 relative, adapters 1e-5 absolute, base unchanged), the frozen chunks hold each
rank's pieces only, the saved adapter loads with ``PeftModel.from_pretrained`` equal to plain PEFT's
and the merged directory equals PEFT's ``merge_and_unload``; and a meta-device LoRA model reads its
base from a directory on stages and in tensor pieces.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.engine_launch import launch

LOSS_REL = 1e-5
WEIGHT_ABS = 1e-5
LOGITS_ABS = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.distributed import lora_worker

    root = tmp_path_factory.mktemp("lora")
    lora_worker.base_model(seed=9).save_pretrained(root / "base")
    cases = [
        dict(kind="train", chunk_size=8192, offload=0.5, out=str(root / "train")),
        dict(kind="weights", chunk_size=8192, offload=0.5, dir=str(root / "base")),
    ]
    per_rank = launch("lora_worker.py", cases, world_size=2, timeout_s=400)
    for rank, rows in enumerate(per_rank):
        for row in rows:
            assert row["ok"], (rank, row.get("error"), row.get("trace"))
    return per_rank


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_steps_equal_plain_peft_with_the_base_frozen_in_sharded_offloaded_chunks(results):
    ranks = [rows[0] for rows in results]
    first = ranks[0]
    assert first["frozen_chunks"] >= 2 and first["offloaded_frozen"] >= 1, first
    # Each rank's loss is the mean over its half of the global batch (equal token counts).
    engine = torch.tensor([ranks[0]["losses"], ranks[1]["losses"]]).mean(0)
    reference = torch.tensor(first["reference_losses"])
    assert torch.allclose(engine, reference, rtol=LOSS_REL, atol=0), (engine, reference)
    assert first["adapters_moved"] > 1e-3  # training changed every adapter matrix
    assert first["adapter_max_diff"] <= WEIGHT_ABS, first["adapter_max_diff"]
    assert all(".lora_" in name for name in first["adapter_names"])
    assert first["base_unchanged"] and first["base_checked"] > 10
    for row in ranks:
        # Frozen chunks: compute-dtype (fp32 here) weights only, no gradient or optimizer state.
        assert row["frozen_shard_bytes"] == row["frozen_shard_numel"] * 4


@pytest.mark.slow
@pytest.mark.distributed
def test_saved_adapter_and_merged_model_give_the_trained_logits(results):
    first = results[0][0]
    assert first["adapter_logits_diff"] <= LOGITS_ABS, first["adapter_logits_diff"]
    assert first["merged_logits_diff"] <= LOGITS_ABS, first["merged_logits_diff"]
    assert not first["merged_has_adapters"]


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_base_reads_a_hugging_face_directory_and_adapters_start_as_peft_starts_them(results):
    row = results[0][1]
    assert row["base_equal"] and row["bases"] > 10, row
    assert row["adapter_diff"] == 0.0 and row["b_zero"], row


@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    from tests.distributed import lora_worker

    root = tmp_path_factory.mktemp("lora_parallel")
    lora_worker.base_model(seed=9).save_pretrained(root / "base")
    cases = [
        dict(kind="parallel", stages=2, chunk_size=8192, out=str(root / "pipeline")),
        dict(kind="parallel", tensor=2, chunk_size=8192, offload=0.5, out=str(root / "tensor")),
        dict(kind="parallel", tensor=2, chunk_size=8192, sequence_parallel=False, out=str(root / "tensor_no_sp")),
        dict(kind="weights", stages=2, chunk_size=8192, offload=0.0, dir=str(root / "base")),
        dict(kind="weights", tensor=2, chunk_size=8192, offload=0.5, dir=str(root / "base")),
    ]
    per_rank = launch("lora_worker.py", cases, world_size=2, timeout_s=400)
    for rank, rows in enumerate(per_rank):
        for row in rows:
            assert row["ok"], (rank, row.get("error"), row.get("trace"))
    return per_rank


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", [0, 1, 2], ids=["pipeline2", "tensor2", "tensor2_no_sequence_parallel"])
def test_lora_on_stages_and_tensor_pieces_equals_plain_peft_and_saves_what_peft_loads(parallel_results, case):
    ranks = [rows[case] for rows in parallel_results]
    first = ranks[0]
    for row in ranks:  # every rank returns the step's mean loss
        assert torch.allclose(
            torch.tensor(row["losses"]), torch.tensor(first["reference_losses"]), rtol=LOSS_REL, atol=0
        )
        # Frozen chunks: compute-dtype (fp32) weights only, each slot this rank's piece (the table's local shape).
        assert row["frozen_chunks"] >= 2 and row["frozen_shard_bytes"] == row["frozen_shard_numel"] * 4
        assert row["frozen_local"]
    assert first["adapters_moved"] > 1e-3
    assert first["adapter_max_diff"] <= WEIGHT_ABS, first["adapter_max_diff"]
    assert first["base_unchanged"] and first["base_checked"] > 10
    assert first["loaded_adapter_diff"] <= WEIGHT_ABS, first["loaded_adapter_diff"]
    assert first["merged_keys_equal"] and first["merged_diff"] <= WEIGHT_ABS, first["merged_diff"]
    if case == 0:  # each stage holds its own blocks' frozen chunks
        names = [set(row["frozen_names"]) for row in ranks]
        assert not names[0] & names[1]
        assert any(".layers.0." in n for n in names[0]) and any(".layers.1." in n for n in names[1])
    else:  # the base's attention and MLP weights are split; the adapters as elixir_tune/models/lora_layout.py places them
        assert first["frozen_split"] >= 8
        placed = first["placements"]
        assert placed["self_attn.q_proj.base_layer.weight"] == "(Shard(dim=0),)"
        assert placed["self_attn.q_proj.lora_A.default.weight"] == "(Replicate(),)"
        assert placed["self_attn.q_proj.lora_B.default.weight"] == "(Shard(dim=0),)"
        assert placed["mlp.down_proj.base_layer.weight"] == "(Shard(dim=1),)"
        assert placed["mlp.down_proj.lora_A.default.weight"] == "(Shard(dim=1),)"
        assert placed["mlp.down_proj.lora_B.default.weight"] == "(Replicate(),)"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", [3, 4], ids=["pipeline2", "tensor2"])
def test_a_meta_lora_model_reads_its_base_on_stages_and_in_tensor_pieces(parallel_results, case):
    row = parallel_results[0][case]
    assert row["base_equal"] and row["bases"] > 10, row
    assert row["adapter_diff"] == 0.0 and row["b_zero"], row
