"""The profile's activation bytes against what a real forward on the CPU saves for backward.

The real side: one forward of the tiny causal LM of each family (``stage_families``) in training
mode, counting the distinct storages autograd saves for backward
(``torch.autograd.graph.saved_tensors_hooks``), parameters left out, each attributed to the block
whose forward first saved it. Two batch sizes give bytes per sample, as the profile's lines do.

* Per block: the profile's ``activation_bytes_per_sample`` summed over the blocks is within 10% of
  the bytes the blocks' forwards save (a block's output, which the profile counts, is saved by the
  next block's first norm: the same count of hidden-sized tensors either way).
* Whole model: the profile's peak per sample (``activation.per_sample_bytes``, what the cost model
  uses) is at least what the forward saves, and at most 1.35x it: the peak also holds backward's
  transients (the gradient of the logits and of the block being differentiated).

Falcon calls attention with one key/value head for several query heads and no ``enable_gqa``: torch
runs the math path there, which saves the seq x seq attention matrix; the profile once routed every
call to a fused kernel and counted 0.73x of the blocks' bytes.
"""

from __future__ import annotations

import pytest
import torch

from elixir_tune.profiler import profile_model
from elixir_tune.profiler.blocks import find_block_list
from elixir_tune.profiler.source import ModelSource
from tests.unit.models import stage_families

SEQ = 32
BATCH = 2
FAMILIES = ["gpt2", "llama", "opt", "gpt_neox", "falcon", "bloom"]
BLOCK_TOLERANCE = 0.10
PEAK_OVER_SAVED_MAX = 1.35


def example_batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, stage_families.VOCAB, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def saved_bytes(model: torch.nn.Module, batch: dict) -> tuple[int, int]:
    """(all, inside blocks): bytes of distinct storages one forward saves for backward, parameters left out."""
    _, blocks = find_block_list(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside: list[bool] = [False]
    sizes: dict[int, int] = {}
    in_block: dict[int, bool] = {}
    hooks = []
    for block in blocks:
        hooks.append(block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)))
        hooks.append(block.register_forward_hook(lambda *_: inside.__setitem__(0, False)))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address and address not in params:
            sizes[address] = max(sizes.get(address, 0), storage.nbytes())
            in_block.setdefault(address, inside[0])
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(**batch).loss  # noqa: B018 - the forward is what is measured
    finally:
        for hook in hooks:
            hook.remove()
    return sum(sizes.values()), sum(size for address, size in sizes.items() if in_block[address])


@pytest.mark.parametrize("family", FAMILIES)
def test_profile_activation_bytes_match_a_real_forward(family: str):
    source = ModelSource(
        name=family,
        source=f"stage_families:{family}",
        vocab_size=stage_families.VOCAB,
        max_seq_len=64,
        _build=lambda: stage_families.build(family),
        _batch=example_batch,
    )
    profile = profile_model(source, batch_size=BATCH, seq_len=SEQ)
    torch.manual_seed(0)
    model = stage_families.build(family).train()
    small_all, small_blocks = saved_bytes(model, example_batch(BATCH, SEQ))
    large_all, large_blocks = saved_bytes(model, example_batch(2 * BATCH, SEQ))
    saved_per_sample = (large_all - small_all) / BATCH
    blocks_per_sample = (large_blocks - small_blocks) / BATCH
    profiled_blocks = sum(block.activation_bytes_per_sample for block in profile.blocks)
    peak = profile.activation.per_sample_bytes
    detail = (
        f"{family}: forward saves {saved_per_sample:.0f} B/sample ({blocks_per_sample:.0f} in blocks); profile "
        f"peak {peak} ({peak / saved_per_sample:.3f}x), blocks {profiled_blocks} "
        f"({profiled_blocks / blocks_per_sample:.3f}x)"
    )
    print(detail)
    assert abs(profiled_blocks / blocks_per_sample - 1) <= BLOCK_TOLERANCE, detail
    assert saved_per_sample <= peak <= PEAK_OVER_SAVED_MAX * saved_per_sample, detail
    # What is live when block 0 begins (a pipeline's first stage holds it): block 0's input at least
    # (hidden 32 in fp32), at most a few hidden-sized tensors (GPT-2's forward still holds its
    # inputs_embeds then; OPT's 4-D causal mask and BLOOM's alibi are seq-sized per sample).
    hidden_bytes = 32 * SEQ * 4
    assert hidden_bytes <= profile.prologue_bytes_per_sample <= 4 * hidden_bytes, (
        family,
        profile.prologue_bytes_per_sample,
    )


def _gpt2_with_dropout():
    import transformers

    config = transformers.GPT2Config(
        vocab_size=stage_families.VOCAB, n_embd=32, n_head=4, n_layer=2, n_positions=64, use_cache=False
    )  # GPT-2's default dropout: 0.1 on the attention, the residuals and the embeddings
    return transformers.GPT2LMHeadModel(config)


def test_attention_dropout_on_the_cpu_keeps_the_scores_the_profile_records():
    """GPT-2 with its default attention dropout: torch's CPU attention then runs its math path, which
    saves the scores for backward; the profile (a GPU's fused kernel) records the score elements per
    block (heads x seq^2), and with the CPU's bytes per score element
    (``memory.CPU_DROPOUT_ATTENTION_BYTES``) the blocks' bytes match the real forward's within 10%,
    where without them they fall short by more than that."""
    from elixir_tune.costmodel.memory import CPU_DROPOUT_ATTENTION_BYTES

    source = ModelSource(
        name="gpt2-dropout",
        source="gpt2-dropout",
        vocab_size=stage_families.VOCAB,
        max_seq_len=64,
        _build=_gpt2_with_dropout,
        _batch=example_batch,
    )
    profile = profile_model(source, batch_size=BATCH, seq_len=SEQ)
    assert [b.dropout_scores_per_sample for b in profile.blocks] == [4 * SEQ * SEQ] * 2
    torch.manual_seed(0)
    model = _gpt2_with_dropout().train()
    _, small_blocks = saved_bytes(model, example_batch(BATCH, SEQ))
    _, large_blocks = saved_bytes(model, example_batch(2 * BATCH, SEQ))
    blocks_per_sample = (large_blocks - small_blocks) / BATCH
    fused = sum(block.activation_bytes_per_sample for block in profile.blocks)
    cpu = fused + sum(b.dropout_scores_per_sample for b in profile.blocks) * CPU_DROPOUT_ATTENTION_BYTES["fp32"]
    detail = f"forward saves {blocks_per_sample:.0f} B/sample in blocks; profile {fused}, with the CPU's scores {cpu}"
    print(detail)
    assert abs(cpu / blocks_per_sample - 1) <= BLOCK_TOLERANCE, detail
    assert fused / blocks_per_sample < 1 - BLOCK_TOLERANCE, detail
    without = profile_model(
        ModelSource(
            name="gpt2",
            source="stage_families:gpt2",
            vocab_size=stage_families.VOCAB,
            max_seq_len=64,
            _build=lambda: stage_families.build("gpt2"),
            _batch=example_batch,
        ),
        batch_size=BATCH,
        seq_len=SEQ,
    )
    assert all(b.dropout_scores_per_sample == 0 for b in without.blocks)
