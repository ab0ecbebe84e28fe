"""Output shapes of meta ops, remembered so that repeated layers skip torch's meta kernels."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


class MetaOpCache:
    """Remembers the output shapes of meta ops, so repeated layers skip torch's meta kernels.

    Many meta kernels are Python reference implementations (a millisecond for a layer norm), and
    a 96-layer model calls each one with the same shapes hundreds of times. An op that neither
    mutates nor aliases its inputs and returns fresh, compact tensors is fully described by its
    inputs' shapes, strides and dtypes and its other arguments; its outputs are then rebuilt with
    ``empty_strided``. Anything else runs normally.
    """

    _UNCACHEABLE = object()

    def __init__(self) -> None:
        self._outputs: dict = {}
        self._func_ok: dict = {}

    def key(self, func, args, kwargs):
        """A hashable description of the call, or None when the op must run."""
        ok = self._func_ok.get(func)
        if ok is None:
            ok = self._func_ok[func] = not func.is_view and not func._schema.is_mutable
        if not ok:
            return None
        try:
            key = (func, _describe(args), _describe(tuple(sorted(kwargs.items()))))
            hash(key)
        except _NotCacheable:
            return None
        except TypeError:
            return None
        return key

    def get(self, key):
        """(outputs, flops) rebuilt for a call seen before, else None."""
        if key is None:
            return None
        entry = self._outputs.get(key)
        if entry is None or entry is self._UNCACHEABLE:
            return None
        specs, is_sequence, op_flops = entry
        outs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in specs]
        return (tuple(outs) if is_sequence else outs[0]), op_flops

    def remember(self, key, args, out, op_flops: float) -> None:
        """Stores the outputs of a call made for ``key`` (or marks it as one that must run)."""
        if key is None or key in self._outputs:
            return
        is_sequence = isinstance(out, (tuple, list))
        outs = list(out) if is_sequence else [out]
        inputs = {t.untyped_storage()._cdata for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)}
        specs, seen = [], set()
        for tensor in outs:
            if not isinstance(tensor, torch.Tensor) or not tensor.is_meta or tensor.storage_offset() != 0:
                self._outputs[key] = self._UNCACHEABLE
                return
            storage = tensor.untyped_storage()
            compact = (
                0
                if tensor.numel() == 0
                else (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)))
                * tensor.element_size()
            )
            if storage._cdata in inputs or storage._cdata in seen or storage.nbytes() != compact:
                self._outputs[key] = self._UNCACHEABLE
                return
            seen.add(storage._cdata)
            specs.append((tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype))
        self._outputs[key] = (specs, is_sequence, op_flops)


_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


class _NotCacheable(Exception):
    pass


def _describe(value):
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            raise _NotCacheable
        return ("T", tuple(value.shape), tuple(value.stride()), value.dtype, value.storage_offset())
    if isinstance(value, (tuple, list)):
        return tuple(_describe(item) for item in value)
    if value is None or isinstance(value, _PLAIN):
        return type(value), value  # 2, 2.0 and True are equal keys but promote differently
    raise _NotCacheable
