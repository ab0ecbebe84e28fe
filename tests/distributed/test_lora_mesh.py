"""LoRA on pipeline stages of tensor pieces, and packed rows on pipeline stages, against plain transformers and
PEFT: one launch at world 4 (gloo, CPU; lora_mesh_worker.py), tiny models of several families (hidden 32,
3 blocks on 2 stages, 2 steps of 2 micro-batches, fp32, ``weight_by_tokens=True`` as the fine-tuning recipe).

* LoRA at pipeline 2 x tensor 2 (1d), adapters on q, v and down projections, the base in frozen chunks
  holding each rank's tensor pieces: Llama (sequence parallel, half of the chunks offloaded, a checkpoint
  saved after step 1 and loaded to repeat step 2 bitwise; position ids of the wrong shape refused), Qwen2
  (the frozen embedding tied to the head, shared by both stages; padded micro-batches), Qwen3 (per-head
  norms, no sequence parallelism) and Gemma2 (four norms per block, tied, soft-capped logits), the last two
  on packed rows.
* Packed rows (``position_ids`` restarting at each sample, no mask) at pipeline 2 x data 2 on GPT-2, whose
  learned positions read them on the first stage, besides the packed LoRA cases above. Each packed case
  also shows that the rows' samples would see each other without their ``position_ids``.
* ``save_adapter`` and ``save_merged`` of a LoRA Llama at pipeline 2 x tensor 2: the adapter
  ``PeftModel.from_pretrained`` loads and the merged directory equal plain PEFT's (lora_worker.py's case).

Every case: losses 1e-5 relative, all weights 1e-5 absolute (the adapters trained, the base bitwise unchanged).
"""

from __future__ import annotations

import pytest

from tests.distributed.engine_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LOSS_REL = 1e-5
WEIGHT_ABS = 1e-5
LEAK_REL = 1e-3  # a packed step's loss moves at least this much when its samples see each other
PP_TP = dict(stages=2, tensor=2)
FAMILY_CASES = [
    dict(family="llama", lora=True, offload=0.5, resume=True, **PP_TP),
    dict(family="qwen2", lora=True, batches="padded", **PP_TP),
    dict(family="qwen3", lora=True, batches="packed", sequence_parallel=False, **PP_TP),
    dict(family="gemma2", lora=True, batches="packed", **PP_TP),
    dict(family="gpt2", batches="packed", stages=2, tensor=1),  # pipeline 2 x data 2
]


def case_id(case: dict) -> str:
    layout = f"pp{case['stages']}xtp{case['tensor']}" if case["tensor"] > 1 else f"pp{case['stages']}xdp2"
    return f"{case['family']}-{'lora' if case.get('lora') else 'full'}-{case.get('batches', 'plain')}-{layout}"


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    from tests.distributed import lora_worker

    root = tmp_path_factory.mktemp("lora_mesh")
    lora_worker.base_model(seed=9).save_pretrained(root / "base")
    save_case = dict(kind="parallel", chunk_size=8192, out=str(root / "saved"), **PP_TP)
    per_rank = launch("lora_mesh_worker.py", [*FAMILY_CASES, save_case], world_size=4, timeout_s=900)
    for rank, rows in enumerate(per_rank):
        for row in rows:
            assert row["ok"], (rank, row.get("error"), row.get("trace"))
    return per_rank


@pytest.mark.parametrize("index", range(len(FAMILY_CASES)), ids=[case_id(c) for c in FAMILY_CASES])
def test_lora_and_packed_rows_on_stages_equal_plain_transformers(world4, index):
    case = FAMILY_CASES[index]
    ranks = [rows[index] for rows in world4]
    first = ranks[0]
    assert first["same_names"]
    assert first["loss_rel"] <= LOSS_REL, (first["losses"], first["reference_losses"])
    assert first["weight_abs"] <= WEIGHT_ABS, first["weight_abs"]
    if case.get("lora"):
        assert first["adapters"] >= 9 and first["adapters_moved"] > 1e-3, first
        assert first["base_unchanged"]
        for row in ranks:  # frozen chunks: this rank's tensor pieces, compute-dtype (fp32) weights only
            assert row["frozen_chunks"] >= 2 and row["frozen_local"], row
            assert row["frozen_shard_bytes"] == row["frozen_shard_numel"] * 4, row
    if case.get("batches") == "packed":  # dropping the position ids would have changed the loss
        packed, leaky = first["reference_losses"][0], first["leaky_losses"][0]
        assert abs(packed - leaky) / packed > LEAK_REL, (packed, leaky)
    if case.get("resume"):  # the checkpoint of step 1 repeats step 2 bitwise
        assert first["resumed_losses"] == first["losses"][1:] and all(row["resumed_equal"] for row in ranks)
        for row in ranks:
            assert row["bad_positions_error"].startswith(
                "micro-batch 0: position_ids has shape (2, 7), input_ids (2, 8)"
            )


def test_lora_on_stages_of_tensor_pieces_saves_the_adapter_and_merged_model_peft_gives(world4):
    first = world4[0][len(FAMILY_CASES)]
    assert first["loaded_adapter_diff"] <= WEIGHT_ABS, first["loaded_adapter_diff"]
    assert first["merged_keys_equal"] and first["merged_diff"] <= WEIGHT_ABS, first["merged_diff"]
    assert first["adapter_max_diff"] <= WEIGHT_ABS and first["base_unchanged"]
    assert first["frozen_split"] >= 4  # the base's attention and MLP weights are split over the tensor group
