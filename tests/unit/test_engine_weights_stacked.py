"""Fused expert tensors read from the one-tensor-per-expert checkpoints transformers writes
(engine/io/stacked.py through ``WeightsReader``): tiny Qwen3-MoE and Mixtral (4 experts, hidden 32)
saved by ``save_pretrained``, read into a meta-device model of the same config."""

from __future__ import annotations

import pytest
import torch

from elixir_tune.engine.io.weights import WeightsError, WeightsReader
from tests.zoo.models import build

EXPERTS = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def saved(request, tmp_path_factory):
    """(directory, the model's state dict, a meta-device model of its config)."""
    import transformers

    torch.manual_seed(0)
    model = build(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(model.config)
    return directory, model.state_dict(), meta


def test_files_hold_one_tensor_per_expert(saved):
    directory, state, meta = saved
    reader = WeightsReader(directory, meta)
    fused = [name for name in state if name.endswith(EXPERTS)]
    assert fused and set(fused) <= set(reader.stacked)  # none of them is in the files under its own name
    assert not set(fused) & set(reader.shapes)


def test_reads_whole_ranges_and_pieces(saved):
    directory, state, meta = saved
    reader = WeightsReader(directory, meta)
    for name in reader.stacked:
        whole = state[name]
        assert torch.equal(reader.read_full(name), whole)
        flat = whole.reshape(-1)
        row = flat.numel() // whole.shape[0]
        # A range inside one expert, one across experts, one expert rank's slice (experts 2 and 3).
        for begin, end in [(3, 17), (row - 5, 2 * row + 7), (2 * row, 4 * row)]:
            assert torch.equal(reader.read_range(name, begin, end), flat[begin:end].float()), (name, begin, end)
        # A tensor rank's piece: experts 1..3, the second half of dimension 1, all of dimension 2.
        half = whole.shape[1] // 2
        runs = [[(1, 3)], [(half, whole.shape[1])], [(0, whole.shape[2])]]
        assert torch.equal(reader.read_piece(name, runs), whole[1:3, half:].float())


def test_a_missing_expert_is_listed(saved, tmp_path):
    """A checkpoint lacking one expert's tensor cannot make the fused tensor: it is reported missing."""
    from safetensors.torch import load_file, save_file

    directory, _, meta = saved
    tensors = load_file(str(directory / "model.safetensors"))
    dropped = next(name for name in tensors if ".experts.3." in name)
    del tensors[dropped]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="missing"):
        WeightsReader(tmp_path, meta)
