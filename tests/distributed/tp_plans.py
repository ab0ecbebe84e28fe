"""Hand-made tensor-parallel plans and the small transformers models of the tensor-parallel tests.

``make_tp_plan`` packs each tensor rank's LOCAL pieces (``plan.tensor_layout.local_shape``) into
chunks, as the search does, for a world of data x tensor ranks.
"""

from __future__ import annotations

import math

from torch import nn

from elixir_tune.plan import (
    Checkpointing,
    ChunkPlan,
    ClusterInfo,
    MemoryPlan,
    ModelInfo,
    ParallelPlan,
    Plan,
    TensorParallel,
    TrainingInfo,
    validate,
)
from elixir_tune.plan.memory import align_up, chunk_size_multiple, padded_offsets
from elixir_tune.plan.tensor_layout import local_shape
from tests.distributed.engine_plans import VOCAB, min_cache_blocks, model_fingerprint


def tiny_llama_gqa(seed: int = 0) -> nn.Module:
    """A Llama with grouped-query attention: 4 query heads, 2 key/value heads, 2 layers, untied."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def local_numel(name: str, shape: list[int], model_type: str, tensor: int, mode: str) -> int:
    return math.prod(local_shape(name, shape, model_type, tensor, mode))


def pack_local(model: nn.Module, chunk_size: int, tensor: int, mode: str) -> list[list[tuple[str, int]]]:
    """Greedy first-fit in registration order of each rank's local pieces (name, local numel)."""
    model_type = model.config.model_type
    chunks: list[list[tuple[str, int]]] = [[]]
    used = 0
    for name, param in model.named_parameters():
        numel = local_numel(name, list(param.shape), model_type, tensor, mode)
        if align_up(used) + numel > chunk_size and chunks[-1]:
            chunks.append([])
            used = 0
        chunks[-1].append((name, numel))
        used = align_up(used) + numel
    return chunks


def make_tp_plan(
    model: nn.Module,
    world_size: int,
    tensor: int,
    chunk_size: int,
    mode: str = "1d",
    sequence_parallel: bool = True,
    cache: str | int = "all",
    offload: float = 0.0,
    checkpoint_every: int = 0,
    block_list: str = "",
    micro_batch_size: int = 2,
    grad_accum_steps: int = 1,
    seq_len: int = 8,
) -> Plan:
    """A valid plan for ``model`` on ``world_size`` ranks, ``tensor`` of them per tensor group."""
    data = world_size // tensor
    chunk_size = align_up(chunk_size, chunk_size_multiple(data))
    packed = pack_local(model, chunk_size, tensor, mode)
    offloaded = {i for i in range(len(packed)) if math.floor((i + 1) * offload) > math.floor(i * offload)}
    chunks = [
        ChunkPlan(id=i, params=[n for n, _ in c], numel=padded_offsets([k for _, k in c])[1], offload=i in offloaded)
        for i, c in enumerate(packed)
    ]
    blocks = len(chunks) if cache == "all" else min_cache_blocks(model, packed, set()) if cache == "min" else int(cache)
    config = model.config
    plan = Plan(
        model=ModelInfo(
            source="tests",
            fingerprint=model_fingerprint(model),
            num_params=sum(p.numel() for p in model.parameters()),
            name=type(model).__name__,
            block_list=block_list,
            num_blocks=len(model.get_submodule(block_list)) if block_list else 0,
            model_type=config.model_type,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        ),
        cluster=ClusterInfo(hardware="test", nodes=1, gpus_per_node=world_size, device="cpu", backend="gloo"),
        training=TrainingInfo(
            dtype="fp32",
            global_batch_size=micro_batch_size * grad_accum_steps * data,
            micro_batch_size=micro_batch_size,
            grad_accum_steps=grad_accum_steps,
            seq_len=seq_len,
            activation_checkpointing=Checkpointing(every=checkpoint_every),
        ),
        memory=MemoryPlan(chunk_size=chunk_size, cache_blocks=blocks, prefetch=0, chunks=chunks),
        parallel=ParallelPlan(tensor=TensorParallel(degree=tensor, mode=mode, sequence_parallel=sequence_parallel)),
    )
    problems = validate(plan)
    assert not problems, problems
    return plan
