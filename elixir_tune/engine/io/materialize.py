"""Where the first weights come from: a model built on the meta device, a checkpoint, or the model itself.

``setup`` takes a model whose parameters (and buffers) may be on the meta device. A
``WeightSource`` then gives each chunk the values of this rank's shard, one chunk at a time, so no
rank ever holds the full model:

* ``FileSource``: slices of a safetensors checkpoint (``weights=PATH``), read per rank;
* ``InitSource``: the model's own initializer, run on the CPU over small *units* of the model;
* ``BroadcastSource``: a model built with real weights (the old path: rank 0's weights win).

Initialization units make the result deterministic whatever the world size, chunk size and offload
(``initializer.py``); a rank initializes only the units that overlap its shards.

Under a tensor-parallel plan the model is split while still on the meta device (its parameters
become DTensors with meta local pieces), and the source is told the split (``WeightSource.split``):
it then gives each parameter's values as this rank's piece, a file source reading only that piece's
slices (``Layout.local_runs``, ``WeightsReader.read_piece``), the initializer cutting the piece from
the unit it initializes. Meta DTensors become real ones in place (``torch.utils.swap_tensors``: the
parameter objects, and so the optimizer's references, stay).

Under expert parallelism each rank keeps a slice of every expert tensor (its experts: rows of
dimension 0), and the source is told that split too (``WeightSource.experts``): the initializer's
full value is cut to the slice, and a file source reads only the slice's rows (one contiguous range
of the file's tensor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from elixir_tune.engine.comm import is_dtensor
from elixir_tune.engine.io.initializer import Initializer, MaterializeError, tensor_registrations
from elixir_tune.engine.io.weights import WeightsReader
from elixir_tune.models.lora import adapter_init
from elixir_tune.models.lora_layout import is_adapter_name

if TYPE_CHECKING:
    from elixir_tune.engine.comm import DTensor


def is_meta(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.is_meta


def has_meta(model: nn.Module) -> bool:
    """Whether some parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in model.parameters()) or any(b.is_meta for b in model.buffers())


class WeightSource:
    """Gives the values of this rank's shard of each chunk, and of the replicated tensors.

    Attributes:
        split: the model's tensor-parallel split (``TensorSplit``) when its parameters are DTensors:
            a parameter's values are then this rank's piece (its ``_local_tensor``). None otherwise.
        experts: the model's expert split (``ExpertSplit``) under expert parallelism: an expert
            tensor's values are then this rank's experts (its slice of dimension 0). None otherwise.
    """

    split: Any = None
    experts: Any = None  # the model's ExpertSplit under expert parallelism: expert tensors are this rank's rows

    def local(self, tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``value``, the full value of ``tensor`` (``value`` itself unless split)."""
        if is_dtensor(value):
            return value._local_tensor
        if self.experts is not None:
            value = self.experts.local_value(tensor, value)
        if self.split is None or not is_dtensor(tensor):
            return value
        return self.split.local_value(tensor, value)

    def sharded(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is split over the tensor ranks (each holds a different piece)."""
        return self.split is not None and is_dtensor(tensor) and self.split.layout(tensor).sharded

    def shard(self, chunk) -> torch.Tensor:
        """This rank's part of ``chunk``, fp32, ``chunk.shard_numel`` elements (padding zero)."""
        shard = torch.zeros(chunk.shard_numel, dtype=torch.float32)
        for slot in chunk.slots:
            owned = chunk.owned_range(slot)
            if owned is None:
                continue
            begin, end = owned
            first = chunk.shard_begin + begin - slot.offset  # element of the parameter
            shard[begin:end].copy_(self.read_range(slot.param, first, first + end - begin))
        self.done_chunk()
        return shard

    def read_range(self, param: torch.Tensor, begin: int, end: int) -> torch.Tensor:
        raise NotImplementedError

    def done_chunk(self) -> None:
        """A chunk is complete: drop what only it needed."""

    def full(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The whole value of a replicated tensor (frozen parameter, buffer), or None to keep it as is."""
        raise NotImplementedError


class InitSource(WeightSource):
    """The model's own initializer (meta tensors) or the model's own values (real ones)."""

    def __init__(self, initializer: Initializer):
        self.initializer = initializer

    def read_range(self, param: torch.Tensor, begin: int, end: int) -> torch.Tensor:
        return self.local(param, self.initializer.value(param)).reshape(-1)[begin:end].float()

    def full(self, tensor: torch.Tensor) -> torch.Tensor | None:
        if id(tensor) not in self.initializer.meta:
            return None
        return self.local(tensor, self.initializer.value(tensor))


class FileSource(WeightSource):
    """A safetensors checkpoint; tensors it lacks (buffers only: missing parameters are refused) are
    initialized when they are on the meta device, or kept. A LoRA model's adapter parameters, which
    no base checkpoint holds, start as PEFT starts them, from the seed (``lora.adapter_init``)."""

    def __init__(self, reader: WeightsReader, initializer: Initializer | None, model: nn.Module, seed: int):
        self.reader = reader
        self.initializer = initializer
        self.seed = seed
        self.adapter_names = {
            id(param): name
            for name, param in model.named_parameters()
            if id(param) not in reader.names and is_adapter_name(name)
        }
        self._piece: tuple[int, torch.Tensor] | None = None  # the last split parameter's piece, flat

    def _read_piece(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a split tensor, fp32, flat; only its slices of the file are read."""
        if self._piece is None or self._piece[0] != id(tensor):
            runs = self.split.layout(tensor).local_runs(tuple(tensor.shape), self.split.coords, self.split.sizes)
            self._piece = (id(tensor), self.reader.read_piece(self.reader.names[id(tensor)], runs).reshape(-1))
            # A column split touches every page of the tensor in the file: unmap them now, not at the
            # chunk's end (a chunk of pieces spans T times its size in the file).
            self.reader.release()
        return self._piece[1]

    def read_range(self, param: torch.Tensor, begin: int, end: int) -> torch.Tensor:
        if id(param) in self.adapter_names:
            # A tensor-parallel adapter (a split layer's lora_A or lora_B) starts as this rank's piece.
            value = self.local(param, adapter_init(self.adapter_names[id(param)], param.shape, self.seed))
            return value.reshape(-1)[begin:end]
        if self.sharded(param):
            return self._read_piece(param)[begin:end]
        first = self.experts.first_element(param) if self.experts is not None else 0
        return self.reader.read_range(self.reader.names[id(param)], first + begin, first + end)

    def done_chunk(self) -> None:
        self.reader.release()  # unmap: the pages of this chunk leave the resident set
        self._piece = None

    def full(self, tensor: torch.Tensor) -> torch.Tensor | None:
        name = self.reader.names.get(id(tensor))
        if name is not None:
            if self.sharded(tensor):
                return self._read_piece(tensor).view(_local_shape(tensor)).to(tensor.dtype)
            if self.experts is not None and id(tensor) in self.experts.param_slices:
                # A frozen expert tensor: this rank's rows only.
                return self.read_range(tensor, 0, tensor.numel()).view(tensor.shape).to(tensor.dtype)
            return self.reader.read_full(name).to(tensor.dtype)
        if self.initializer is not None and id(tensor) in self.initializer.meta:
            return self.local(tensor, self.initializer.value(tensor))
        return None


def make_source(model: nn.Module, weights, seed: int, split: Any = None) -> WeightSource | None:
    """The source of the first weights: None means the model's own (real) weights, broadcast from rank 0.

    Args:
        model: the model (split already when ``split`` is given).
        weights: a safetensors file, index or directory, or None.
        seed: the seed every rank agrees on (for the initializer).
        split: the model's TensorSplit under a tensor-parallel plan: values come as this rank's pieces.

    Raises:
        MaterializeError: meta tensors with no initializer.
        WeightsError: unusable weights (listed).
    """
    meta = has_meta(model)
    source: WeightSource | None = None
    if weights is not None:
        reader = WeightsReader(weights, model)
        provided = set(reader.names) | {id(p) for name, p in model.named_parameters() if is_adapter_name(name)}
        source = FileSource(reader, Initializer(model, seed, provided=provided) if meta else None, model, seed)
    elif meta:
        source = InitSource(Initializer(model, seed))
    if source is not None:
        source.split = split
    return source


def _local_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape of this rank's piece (a DTensor's local tensor; a plain tensor's own)."""
    return tensor._local_tensor.shape if is_dtensor(tensor) else tensor.shape


def _real_dtensor(param: DTensor, local: torch.Tensor) -> nn.Parameter:
    """A parameter holding the DTensor ``param`` (same mesh, placements, global shape) with ``local`` as its piece."""
    from elixir_tune.engine.comm import DTensor  # loaded already: ``param`` is one

    value = DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    return nn.Parameter(value, requires_grad=param.requires_grad)


def materialize_replicated(model: nn.Module, chunked: set[int], source: WeightSource | None) -> None:
    """Gives every tensor outside the chunks (frozen parameters, buffers) its value, in place.

    Parameters keep their identity (``torch.utils.swap_tensors``) so that optimizers and user
    references stay valid; buffers are replaced in every module that registers them.
    """
    if source is None:
        return
    registrations = tensor_registrations(model)
    seen: set[int] = set()
    for tensor in list(model.parameters()) + list(model.buffers()):
        key = id(tensor)
        if key in chunked or key in seen:
            continue
        seen.add(key)
        value = source.full(tensor)
        if value is None:
            continue
        if is_dtensor(tensor):  # a frozen split parameter: its piece, in place
            torch.utils.swap_tensors(tensor, _real_dtensor(tensor, value.detach().clone()))
        elif isinstance(tensor, nn.Parameter):
            replacement = nn.Parameter(value.detach().clone(), requires_grad=tensor.requires_grad)
            torch.utils.swap_tensors(tensor, replacement)
        else:
            value = value.detach().clone()
            for module, attr, _ in registrations[key]:
                module._buffers[attr] = value
    still = [
        n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta and id(t) not in chunked
    ]
    if still:
        raise MaterializeError(f"tensors left on the meta device: {', '.join(still[:8])}")


def swap_meta_for_placeholders(params: list[nn.Parameter], placeholder: torch.Tensor) -> None:
    """Chunked parameters on the meta device become (same objects) expanded views of ``placeholder``:
    the engine points them at chunk payloads afterwards, which a meta tensor cannot be."""
    for param in params:
        if not param.is_meta:
            continue
        if is_dtensor(param):  # a split parameter: a real DTensor whose piece is the placeholder
            replacement = _real_dtensor(param, placeholder.expand(_local_shape(param)))
        else:
            replacement = nn.Parameter(placeholder.expand(param.shape), requires_grad=param.requires_grad)
        torch.utils.swap_tensors(param, replacement)
