"""Chunk packing: which parameters share a chunk, the same way the engine will lay them out.

Parameters are packed greedily in first-use order into chunks of ``chunk_size`` elements (a
parameter is never split); shared (tied) parameters get chunks of their own that stay resident;
frozen parameters (requires_grad False: a LoRA base model) get frozen chunks of their own, which
hold compute-dtype weights only (no master, gradient or optimizer state) and are cached, sharded
and offloaded like any chunk. Under expert parallelism the expert tensors get chunks of their own too
(the engine shards them over another group: ``costmodel/expert.py``). Each parameter starts at an aligned offset
(``elixir_tune.plan.memory.padded_offsets``), as the engine lays it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from elixir_tune.plan.memory import align_up
from elixir_tune.profiler.schema import ModelProfile


@dataclass
class Chunk:
    """One packed chunk.

    Attributes:
        params: indices into ``ModelProfile.params``, in order.
        numel: elements spanned by the parameters, alignment padding between them included (the
            rest of the chunk is padding).
        resident: always gathered (shared parameters).
        frozen: holds frozen parameters only (no gradient, master or optimizer state).
        expert: holds expert tensors only (expert parallelism).
    """

    params: list[int]
    numel: int
    resident: bool = False
    frozen: bool = False
    expert: bool = False


@dataclass
class ChunkLayout:
    """Chunks of one chunk size.

    Attributes:
        chunk_size: elements per chunk.
        chunks: in first-use order, resident ones included.
        chunk_of_param: parameter index -> chunk id.
        frozen_numel: elements of the frozen parameters (in frozen chunks).
        param_numels: elements of each parameter of the profile (for the padding figures).
    """

    chunk_size: int
    chunks: list[Chunk]
    chunk_of_param: list[int]
    frozen_numel: int
    param_numels: tuple[int, ...] = ()

    # The counts are read for every candidate the search scores; a layout is complete when made
    # (``pack_chunks``), so each is counted once.
    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @cached_property
    def num_resident(self) -> int:
        return sum(1 for chunk in self.chunks if chunk.resident)

    @property
    def num_cacheable(self) -> int:
        return self.num_chunks - self.num_resident

    @cached_property
    def num_frozen(self) -> int:
        return sum(1 for chunk in self.chunks if chunk.frozen)

    @cached_property
    def num_expert(self) -> int:
        return sum(1 for chunk in self.chunks if chunk.expert)

    @property
    def padding_numel(self) -> int:
        """Elements of all chunks that hold no parameter (alignment gaps and each chunk's unused
        tail). The cost model counts them: memory, copies and collectives move whole chunks."""
        held = sum(self.param_numels[index] for chunk in self.chunks for index in chunk.params)
        return self.num_chunks * self.chunk_size - held

    @property
    def padding_share(self) -> float:
        """``padding_numel`` over all chunks' elements (0 without chunks)."""
        total = self.num_chunks * self.chunk_size
        return self.padding_numel / total if total else 0.0


def largest_trainable_numel(profile: ModelProfile) -> int:
    """Elements of the largest trainable parameter (its gradient arrives whole before it is staged)."""
    return max((p.numel for p in profile.params if p.requires_grad), default=1)


def largest_param_numel(profile: ModelProfile) -> int:
    """Elements of the largest parameter, frozen ones included: the smallest allowed chunk size."""
    return max((p.numel for p in profile.params), default=1)


def pack_chunks(profile: ModelProfile, chunk_size: int, experts: frozenset[int] = frozenset()) -> ChunkLayout:
    """Packs the parameters into chunks.

    Args:
        profile: the model profile (``params`` in first-use order).
        chunk_size: elements per chunk; at least the largest parameter.
        experts: indices of the expert tensors that expert parallelism splits (chunks of their own).

    Returns:
        The layout: shared parameters in resident chunks, frozen ones in frozen chunks, expert
        tensors in expert chunks, each kind in first-use order.

    Raises:
        ValueError: a parameter is larger than ``chunk_size``.
    """
    chunks: list[Chunk] = []
    chunk_of_param = [-1] * len(profile.params)
    # (resident, frozen, expert) -> the chunk of that kind still being filled
    open_chunk: dict[tuple[bool, bool, bool], int | None] = {}
    frozen_numel = 0
    for index, param in enumerate(profile.params):
        frozen = not param.requires_grad
        if frozen:
            frozen_numel += param.numel
        if param.numel > chunk_size:
            raise ValueError(f"parameter {param.name} has {param.numel} elements, more than chunk_size {chunk_size}")
        resident = bool(param.shared)
        expert = index in experts
        kind = (resident, frozen, expert)
        current = open_chunk.get(kind)
        if current is None or align_up(chunks[current].numel) + param.numel > chunk_size:
            chunks.append(Chunk(params=[], numel=0, resident=resident, frozen=frozen, expert=expert))
            current = open_chunk[kind] = len(chunks) - 1
        chunks[current].params.append(index)
        chunks[current].numel = align_up(chunks[current].numel) + param.numel
        chunk_of_param[index] = current
    return ChunkLayout(
        chunk_size=chunk_size,
        chunks=chunks,
        chunk_of_param=chunk_of_param,
        frozen_numel=frozen_numel,
        param_numels=tuple(p.numel for p in profile.params),
    )


def least_padded_sizes(profile: ModelProfile, sizes: list[int], count: int) -> list[int]:
    """The ``count`` chunk sizes of ``sizes`` whose packing leaves the least padding
    (``ChunkLayout.padding_share``; ties: the smaller size), ascending."""
    scored = sorted((pack_chunks(profile, size).padding_share, size) for size in sizes)
    return sorted(size for _, size in scored[:count])


def max_module_chunks(profile: ModelProfile, layout: ChunkLayout) -> int:
    """The most non-resident chunks one module holds gathered while it runs.

    A module's chunks are those of the parameters it owns directly and of those it reads without
    owning them (``ModelProfile.foreign_reads``); while it runs, every enclosing module that owns
    parameters is running too and keeps its chunks gathered. The engine refuses a plan whose cache
    is smaller than this (``ModuleMap.check_cache_fits``), so no plan may have fewer cache blocks.

    Args:
        profile: the model profile (parameter names give the module tree).
        layout: the chunk layout of one chunk size.

    Returns:
        The largest count over the modules.
    """
    index_of = {param.name: index for index, param in enumerate(profile.params)}
    owned: dict[str, set[int]] = {}

    def add(module: str, index: int | None) -> None:
        chunk = layout.chunk_of_param[index] if index is not None else -1
        if chunk >= 0 and not layout.chunks[chunk].resident:
            owned.setdefault(module, set()).add(chunk)

    for index, param in enumerate(profile.params):
        add(param.name.rpartition(".")[0], index)
    for read in profile.foreign_reads:
        for name in read.params:
            add(read.module, index_of.get(name))
    worst = 0
    for module, chunks in owned.items():
        held = set(chunks)
        enclosing = module
        while enclosing:  # "a.b.c" -> "a.b" -> "a" -> "" (the model itself)
            enclosing = enclosing.rpartition(".")[0]
            held |= owned.get(enclosing, set())
        worst = max(worst, len(held))
    return worst
