"""Hand-made plans and small models for the engine tests (no search involved).

``make_plan`` packs a model's trainable parameters in registration order (first-use order for the
test models) into chunks and builds a valid Plan for the given shape; with ``frozen_chunks`` the
frozen parameters go into frozen chunks after them (a LoRA model's base), else they stay replicated.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from elixir_tune.models.lora import lora_settings
from elixir_tune.models.tensor_table import model_tensor_table
from elixir_tune.plan import (
    Checkpointing,
    ChunkPlan,
    ClusterInfo,
    ExpertParallel,
    MemoryPlan,
    ModelInfo,
    ParallelPlan,
    PipelineParallel,
    Plan,
    TensorParallel,
    TrainingInfo,
    fingerprint,
    validate,
)
from elixir_tune.plan.memory import align_up, chunk_size_multiple, padded_offsets
from elixir_tune.profiler.arch import model_arch


def model_fingerprint(model: nn.Module) -> str:
    return fingerprint(
        [
            (name, list(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad)
            for name, p in model.named_parameters()
        ]
    )


def pack(
    model: nn.Module, chunk_size: int, tensor: int = 1, mode: str = "1d", trainable: bool = True
) -> list[list[tuple[str, int]]]:
    """Greedy first-fit in order, parameters at aligned offsets: (name, numel) lists, one per chunk.

    With ``tensor`` > 1 the numels are one tensor rank's local pieces (``plan/tensor_layout.py``
    ``local_shape``), as the search packs them. ``trainable`` False: the frozen parameters instead.
    """
    from elixir_tune.plan.tensor_layout import local_shape

    table = model_tensor_table(model)[0] if tensor > 1 else {}

    def numel(name: str, param: nn.Parameter) -> int:
        if tensor == 1:
            return param.numel()
        return math.prod(local_shape(name, list(param.shape), model.config.model_type, tensor, mode, table))

    chosen = [(name, numel(name, p)) for name, p in model.named_parameters() if p.requires_grad == trainable]
    return _pack_in_order(chosen, chunk_size)


def pack_experts(model: nn.Module, chunk_size: int, degree: int) -> list[list[tuple[str, int]]]:
    """Packs in order, the expert tensors (one expert rank's slice) in chunks apart from the rest."""
    from elixir_tune.engine.parallel.expert_parallel import expert_modules

    experts = {f"{name}.{p}" for name, module in expert_modules(model) for p, _ in module.named_parameters()}
    chunks: list[list[tuple[str, int]]] = []
    run: list[tuple[str, int]] = []
    for name, param in model.named_parameters():
        is_expert = name in experts
        if run and (run[-1][0] in experts) != is_expert:
            chunks += _pack_in_order(run, chunk_size)
            run = []
        run.append((name, param.numel() // degree if is_expert else param.numel()))
    return chunks + (_pack_in_order(run, chunk_size) if run else [])


def _pack_in_order(params: list[tuple[str, int]], chunk_size: int) -> list[list[tuple[str, int]]]:
    chunks: list[list[tuple[str, int]]] = [[]]
    used = 0
    for name, numel in params:
        if align_up(used) + numel > chunk_size and chunks[-1]:
            chunks.append([])
            used = 0
        chunks[-1].append((name, numel))
        used = align_up(used) + numel
    return chunks


def shared_params(model: nn.Module) -> set[str]:
    """Names of parameters registered under several modules (tied weights), as named_parameters gives them."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners[id(param)] = owners.get(id(param), 0) + 1
    return {name for name, p in model.named_parameters() if owners[id(p)] > 1}


def pack_stages(
    model: nn.Module, chunk_size: int, block_list: str, stages: int, assignment: str, trainable: bool = True
) -> tuple[list[list[tuple[str, int]]], list[int]]:
    """A pipeline plan's packing: each stage's trainable parameters (``plan/stages.py``) packed in order
    into that stage's chunks, stage by stage; a tied parameter in a chunk of its own (both stages that
    use it hold that chunk). Returns the chunks and the stage of each. ``trainable`` False: the frozen
    parameters instead (a LoRA base's frozen chunks, stage by stage).

    ``assign_stages`` needs first-use order (the profiler's); registration order is not that for every
    family (OPT registers its final norm before the blocks), so the embeddings the stage adapter runs
    first come first, then the blocks, then the rest.
    """
    from elixir_tune.engine.parallel.pipeline_adapters import adapter_for
    from elixir_tune.plan.stages import assign_stages, block_index_of

    adapter = adapter_for(model, block_list)
    embeddings = {id(p) for module in adapter.first_modules for p in module.parameters()}
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad == trainable]

    def use_order(item: tuple[str, torch.nn.Parameter]) -> int:
        name, param = item
        return 0 if id(param) in embeddings else 1 if block_index_of(name, block_list) is not None else 2

    trainable = [(name, p.numel()) for name, p in sorted(named, key=use_order)]
    num_blocks = len(model.get_submodule(block_list))
    stage_of = assign_stages([name for name, _ in trainable], block_list, num_blocks, stages, assignment)
    tied = shared_params(model)
    chunks: list[list[tuple[str, int]]] = []
    chunk_stages: list[int] = []
    for stage in range(stages):
        for name, numel in trainable:
            if name in tied and stage_of[name] == stage:
                chunks.append([(name, numel)])
                chunk_stages.append(stage)
        rest = [(name, numel) for name, numel in trainable if stage_of[name] == stage and name not in tied]
        packed = _pack_in_order(rest, chunk_size) if rest else []
        chunks += packed
        chunk_stages += [stage] * len(packed)
    return chunks, chunk_stages


def min_cache_blocks(model: nn.Module, chunks: list[list[tuple[str, int]]], resident: set[int]) -> int:
    """Most non-resident chunks a module needs at once: its own and its ancestors' (they are running)."""
    owner = {id(p): name for name, p in model.named_parameters()}
    chunk_of = {name: i for i, chunk in enumerate(chunks) for name, _ in chunk}

    def own(module: nn.Module) -> set[int]:
        return {chunk_of[owner[id(p)]] for p in module.parameters(recurse=False) if owner[id(p)] in chunk_of} - resident

    def walk(module: nn.Module, above: set[int]) -> int:
        mine = own(module)
        here = len(above | mine) if mine else 1
        return max([here] + [walk(child, above | mine) for child in module.children()])

    return walk(model, set())


def make_plan(
    model: nn.Module,
    world_size: int,
    chunk_size: int,
    cache: str | int = "all",
    offload: float = 0.0,
    prefetch: int = 0,
    checkpoint_every: int = 0,
    dtype: str = "fp32",
    resident: tuple[int, ...] = (),
    block_list: str = "",
    micro_batch_size: int = 2,
    grad_accum_steps: int = 1,
    seq_len: int = 8,
    device: str = "cpu",
    staging_buffers: int = 2,
    stages: int = 1,
    assignment: str = "modular",
    schedule: str = "looped_bfs",
    tensor: int = 1,
    tensor_mode: str = "1d",
    sequence_parallel: bool = True,
    frozen_chunks: bool = False,
    expert: int = 1,
) -> Plan:
    """A valid plan for ``model``.

    Args:
        world_size: every process (data x ``stages`` x ``tensor``).
        cache: "all" (every non-resident chunk), "min" (the fewest that work, plus room for
            prefetch), or a number.
        offload: fraction of chunks whose shard lives on the host, spread evenly.
        resident: chunk ids kept gathered (a pipeline plan's tied chunks are resident too).
        stages, assignment, schedule: ``parallel.pipeline``; with stages > 1 each stage's
            parameters are packed apart (``pack_stages``) and ``block_list`` is required.
        tensor, tensor_mode, sequence_parallel: ``parallel.tensor``; with tensor > 1 the chunks hold
            each tensor rank's local pieces.
        frozen_chunks: pack the frozen parameters into frozen chunks (after the trainable ones).
        expert: ``parallel.expert.degree``; above 1 the expert tensors (the model's ep plan) get chunks
            of their own, holding one expert rank's slice.
    """
    data_size = world_size // (stages * tensor)
    chunk_size = align_up(chunk_size, chunk_size_multiple(data_size))
    chunk_stages: list[int] = []
    if stages > 1:
        packed, chunk_stages = pack_stages(model, chunk_size, block_list, stages, assignment)
        tied = shared_params(model)
        resident = tuple(resident) + tuple(i for i, c in enumerate(packed) if c[0][0] in tied)
    elif expert > 1:
        packed = pack_experts(model, chunk_size, expert)
    else:
        packed = pack(model, chunk_size, tensor, tensor_mode)
    frozen_ids: set[int] = set()
    if frozen_chunks:
        if stages > 1:
            frozen_packed, frozen_stages = pack_stages(model, chunk_size, block_list, stages, assignment, False)
            chunk_stages = chunk_stages + frozen_stages
        else:
            frozen_packed = pack(model, chunk_size, tensor, tensor_mode, trainable=False)
            frozen_packed = [chunk for chunk in frozen_packed if chunk]
        frozen_ids = set(range(len(packed), len(packed) + len(frozen_packed)))
        packed = packed + frozen_packed
    offloaded = {i for i in range(len(packed)) if math.floor((i + 1) * offload) > math.floor(i * offload)}
    chunks = [
        ChunkPlan(
            id=i,
            params=[n for n, _ in c],
            numel=padded_offsets([k for _, k in c])[1],
            resident=i in resident,
            offload=i in offloaded,
            stage=chunk_stages[i] if chunk_stages else 0,
            frozen=i in frozen_ids,
        )
        for i, c in enumerate(packed)
    ]
    cacheable = sum(1 for c in chunks if not c.resident)
    if cache == "all":
        blocks = cacheable
    elif cache == "min":
        blocks = min_cache_blocks(model, packed, set(resident))
    else:
        blocks = int(cache)
    blocks = min(max(blocks, prefetch + 1 if prefetch else blocks), cacheable)
    prefetch = min(prefetch, max(blocks - 1, 0))
    num_blocks = len(model.get_submodule(block_list)) if block_list else 0
    config = getattr(model, "config", None)
    plan = Plan(
        model=ModelInfo(
            source="tests",
            fingerprint=model_fingerprint(model),
            num_params=sum(p.numel() for p in model.parameters()),
            name=type(model).__name__,
            block_list=block_list,
            num_blocks=num_blocks,
            model_type=str(getattr(config, "model_type", "") or ""),
            num_heads=getattr(config, "num_attention_heads", 0) or 0,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 0) or 0,
            tensor_layout=model_tensor_table(model)[0] if tensor > 1 else {},
            lora=lora_settings(model),
            num_experts=model_arch(model).num_experts,
        ),
        cluster=ClusterInfo(
            hardware="test",
            nodes=1,
            gpus_per_node=world_size,
            device=device,
            backend="nccl" if device == "cuda" else "gloo",
        ),
        training=TrainingInfo(
            dtype=dtype,
            global_batch_size=micro_batch_size * grad_accum_steps * data_size,
            micro_batch_size=micro_batch_size,
            grad_accum_steps=grad_accum_steps,
            seq_len=seq_len,
            activation_checkpointing=Checkpointing(every=checkpoint_every),
        ),
        memory=MemoryPlan(
            chunk_size=chunk_size,
            cache_blocks=blocks,
            prefetch=prefetch,
            chunks=chunks,
            staging_buffers=staging_buffers,
        ),
        parallel=ParallelPlan(
            pipeline=PipelineParallel(stages=stages, assignment=assignment, schedule=schedule),
            tensor=TensorParallel(degree=tensor, mode=tensor_mode, sequence_parallel=sequence_parallel),
            expert=ExpertParallel(degree=expert),
        ),
    )
    problems = validate(plan)
    assert not problems, problems
    return plan


def plan_for_case(model: nn.Module, world_size: int, case: dict, block_list: str, seq_len: int) -> Plan:
    """``make_plan`` with the shape a test case dict names (chunk_size, cache, offload, prefetch,
    checkpoint, dtype, resident, micro, accum)."""
    return make_plan(
        model,
        world_size,
        case["chunk_size"],
        cache=case.get("cache", "all"),
        offload=case.get("offload", 0.0),
        prefetch=case.get("prefetch", 0),
        checkpoint_every=case.get("checkpoint", 0),
        dtype=case.get("dtype", "fp32"),
        resident=tuple(case.get("resident", ())),
        block_list=block_list,
        micro_batch_size=case.get("micro", 2),
        grad_accum_steps=case.get("accum", 1),
        seq_len=seq_len,
    )


# --- models -------------------------------------------------------------------------------------

VOCAB = 64


def tiny_gpt2_config():
    """GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32), no dropout."""
    from transformers import GPT2Config

    return GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """The tiny GPT-2 of ``tiny_gpt2_config``, seeded."""
    import transformers
    from transformers import GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_gpt2_config())


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.norm(x))))


class TiedNet(nn.Module):
    """Tied embedding/head, a frozen parameter, a module never called, a parameter on the root."""

    def __init__(self, dim: int = 16, blocks: int = 3):
        super().__init__()
        # Owned by the root module (an ancestor of every other module); its backward needs its data.
        self.gain = nn.Parameter(torch.ones(dim))
        self.emb = nn.Embedding(VOCAB, dim)
        self.body = nn.ModuleList([Block(dim) for _ in range(blocks)])
        self.frozen_scale = nn.Parameter(torch.full((dim,), 0.75), requires_grad=False)
        self.unused = nn.Linear(dim, dim)  # never called: its parameters get no gradient
        self.extra = nn.Linear(dim, dim)  # called only while ``use_extra`` is set (some steps)
        self.use_extra = False
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, input_ids, labels):
        h = self.emb(input_ids) * self.gain
        for block in self.body:
            h = block(h)
        if self.use_extra:
            h = h + self.extra(h)
        logits = self.head(h * self.frozen_scale)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return SimpleNamespace(loss=loss, logits=logits)


def tied_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TiedNet()


def batches(steps: int, global_batch: int, seq_len: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Deterministic token batches (input_ids and labels), the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (global_batch, seq_len), generator=generator)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Decay on matrices, none on biases, norms and vectors (two groups, as GPT training does)."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


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
