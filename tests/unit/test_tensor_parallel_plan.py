"""Plan validation rules specific to tensor parallelism, and the engine's parameter layouts (no processes)."""

from __future__ import annotations

import pytest
import torch

from elixir_tune.engine.parallel.tp_layout import Layout, mesh_coords
from elixir_tune.plan import validate_dict
from tests.unit.test_plan_parallel import _with

# The example plan: tiny GPT-2, world 2, micro-batch 4, seq_len 16 (global 16 = 4 x 2 x data).


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        (  # 2d splits the heads by q = 2 only: 6 heads are fine on a 2 x 2 grid, 3 are not
            {"cluster__gpus_per_node": 4, "parallel__tensor__degree": 4, "parallel__tensor__mode": "2d",
             "model__num_heads": 3, "training__global_batch_size": 8},
            "parallel.tensor.degree: 4 (2d: the heads split 2 ways) does not divide model.num_heads 3; "
            "each tensor rank needs whole attention heads",
        ),
        (
            {"cluster__gpus_per_node": 4, "parallel__tensor__degree": 4, "parallel__tensor__mode": "2d",
             "training__micro_batch_size": 3, "training__grad_accum_steps": 1, "training__global_batch_size": 3},
            "training.micro_batch_size: 3 is not a multiple of 2; 2d tensor parallelism splits each micro-batch "
            "over the 2 rows of its grid",
        ),
        (
            {"parallel__tensor__degree": 2, "training__seq_len": 15, "training__global_batch_size": 8},
            "training.seq_len: 15 is not a multiple of the tensor degree 2; sequence parallelism splits every "
            "sample's tokens over the tensor ranks (set parallel.tensor.sequence_parallel: false, or pick a "
            "seq_len that divides)",
        ),
        (
            {"parallel__tensor__degree": 2, "model__model_type": "bloom", "training__global_batch_size": 8},
            "parallel.tensor.degree: 2, but the engine cannot run tensor parallelism for this model: model type "
            "'bloom': no tensor table is recorded for it (tensor parallelism needs a tensor plan for the model's "
            "family, read from its config.base_model_tp_plan when the model is profiled; built-in tables: gpt2); "
            "set it to 1 (search again without --fix tensor=2)",
        ),
        (  # a mixture's experts run 1d only
            {"cluster__gpus_per_node": 4, "parallel__tensor__degree": 4, "parallel__tensor__mode": "2d",
             "training__global_batch_size": 8,
             "model__tensor_layout": {"transformer.h.*.mlp.experts": "experts", "transformer.h.*.ln_1": "norm"}},
            "parallel.tensor.mode: 2d tensor parallelism has no grid form for the tensor plan's style experts "
            "(mixture-of-experts experts); use tensor mode 1d",
        ),
        (
            {"model__tensor_layout": {"transformer.h.*.attn.c_attn": "local_colwise"}},
            "model.tensor_layout: unknown styles transformer.h.*.attn.c_attn: local_colwise (known: colwise, "
            "colwise_gather, rowwise, rowwise_split, vocab, head_norm, norm, experts, packed_colwise, lora_colwise, "
            "lora_rowwise, rowwise_partial, replicated_linear); profile the model and search again",
        ),
    ],
)  # fmt: skip
def test_tensor_parallel_plan_problems(sections, expected):
    assert validate_dict(_with(**sections)) == [expected]


@pytest.mark.parametrize(
    "sections",
    [
        {"cluster__gpus_per_node": 4, "parallel__tensor__degree": 4, "parallel__tensor__mode": "2d",
         "model__num_heads": 6, "training__global_batch_size": 8},
        {"parallel__tensor__degree": 2, "parallel__tensor__sequence_parallel": False, "training__seq_len": 15,
         "training__global_batch_size": 8},
    ],
)  # fmt: skip
def test_tensor_parallel_plans_that_are_fine(sections):
    assert validate_dict(_with(**sections)) == []


@pytest.mark.parametrize(
    ("layout", "sizes"),
    [
        (Layout((0,)), (4,)),
        (Layout((1,), parts=3, fused_dim=1), (2,)),  # GPT-2's c_attn: q | k | v, each split by heads
        (Layout((1, 0)), (2, 2)),  # a 2d linear: input over the grid rows, output over the columns
        (Layout((0, 1), parts=3, fused_dim=1), (2, 2)),
        (Layout((None, 0)), (2, 2)),  # a norm weight on the 2d grid: hidden over the columns
    ],
)
def test_layout_pieces_reassemble_the_full_tensor(layout, sizes):
    full = torch.arange(12 * 24, dtype=torch.float32).view(12, 24)
    ranks = range(int(torch.tensor(sizes).prod()))
    pieces = [layout.local(full, mesh_coords(rank, sizes), sizes) for rank in ranks]
    assert torch.equal(layout.full(pieces, full.shape, sizes), full)
    # Every element is in exactly the pieces of its replicas.
    assert sum(piece.numel() for piece in pieces) == full.numel() * layout.replicas(sizes)


def test_fused_layout_gives_each_rank_its_own_heads_of_q_k_and_v():
    q, k, v = (torch.full((2, 4), float(i)) for i in range(3))
    heads = torch.arange(4.0).repeat(2, 1)  # column c belongs to head c (one column per head)
    full = torch.cat([q + heads, k + heads, v + heads], 1)
    piece = Layout((1,), parts=3, fused_dim=1).local(full, (1,), (2,))
    # Rank 1 of 2 holds heads 2 and 3 of q, then of k, then of v.
    assert piece[0].tolist() == [2.0, 3.0, 3.0, 4.0, 4.0, 5.0]


@pytest.mark.parametrize(
    ("layout", "sizes"),
    [
        (Layout((0,)), (4,)),
        (Layout((1,)), (2,)),  # a row-parallel weight: columns, from every row of the file
        (Layout((1,), parts=3, fused_dim=1), (2,)),  # GPT-2's c_attn: three runs of columns
        (Layout((1, 0)), (2, 2)),
        (Layout((0, 1), parts=3, fused_dim=1), (2, 2)),
        (Layout((None, 0)), (2, 2)),
    ],
)
def test_a_rank_reads_its_piece_from_safetensors(tmp_path, layout, sizes):
    """``Layout.local_runs`` + ``WeightsReader.read_piece`` (the meta-device start of a tensor plan)
    give each rank exactly ``Layout.local`` of the file's tensor, converted to fp32."""
    from safetensors.torch import save_file

    from elixir_tune.engine.io.weights import WeightsReader

    full = torch.arange(12 * 24, dtype=torch.float32).view(12, 24)
    save_file({"weight": full.to(torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    model = torch.nn.Module()
    model.register_parameter("weight", torch.nn.Parameter(torch.empty(12, 24, device="meta")))
    reader = WeightsReader(tmp_path, model)
    for rank in range(int(torch.tensor(sizes).prod())):
        coords = mesh_coords(rank, sizes)
        piece = reader.read_piece("weight", layout.local_runs((12, 24), coords, sizes))
        assert piece.dtype == torch.float32
        assert torch.equal(piece, layout.local(full.to(torch.bfloat16).float(), coords, sizes)), (rank, coords)
    reader.release()
