"""Live activation memory and FLOPs of one traced forward+backward on the meta device.

Meta tensors have no data, but they have storages with sizes, and autograd keeps them alive
exactly as long as a real run would (saved tensors, gradients in flight). A dispatch mode sees
every ATen op output; each new storage is counted when it appears and uncounted by a weakref
finalizer when torch frees it, so ``live_bytes`` follows what a caching allocator would be asked
to hold. FLOPs come from torch's own per-op formulas (``torch.utils.flop_counter``), the bytes of
memory-bound pointwise ops from ``elixir_tune.pointwise``.

Two things a meta run cannot know are assumed: a model that branches on data (``.item()``,
``bool(t)``) sees the usual training batch (every ``all()`` true, no ``any()``), and an op seen
before with the same shapes is not run again (see op_cache).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from elixir_tune.pointwise import pointwise_bytes
from elixir_tune.profiler.op_cache import MetaOpCache

_SCALAR = torch.ops.aten._local_scalar_dense.default
_REDUCTIONS_TO_BOOL = (torch.ops.aten.all, torch.ops.aten.any)


class LiveMemoryMeter(TorchDispatchMode):
    """Counts bytes of live storages created by ops, their peak, and FLOPs.

    Attributes:
        live_bytes: bytes of storages created under the mode and not yet freed.
        peak_bytes: the largest live_bytes seen.
        flops: FLOPs of every op (forward, backward and recomputation).
        pointwise_bytes: bytes written by memory-bound pointwise ops (forward, backward and
            recomputation), ``elixir_tune.pointwise``'s rule.
        block: index of the block whose forward runs now (set by the recorder), or None.
        in_backward: True once backward started (forward ops then are recomputation).
        block_fwd_flops: FLOPs of each block's first (not recomputed) forward.
        param_storages: storage key -> parameter position, of the parameters whose reads are reported.
        on_param_read: called with the position of each such parameter an op takes as an argument
            (itself or a view of it), before the op runs; None: nothing is reported.
    """

    def __init__(self, existing: Iterable[torch.Tensor] = (), op_cache: MetaOpCache | None = None) -> None:
        super().__init__()
        self._op_cache = op_cache if op_cache is not None else MetaOpCache()
        # Parameters, buffers and inputs exist before tracing: views of them are not new memory.
        self._known = {t.untyped_storage()._cdata for t in existing}
        self._live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.flops = 0.0
        self.pointwise_bytes = 0
        self.block: int | None = None
        self.in_backward = False
        self.block_fwd_flops: dict[int, float] = defaultdict(float)
        self._registry = getattr(flop_counter, "flop_registry", {})
        self._bool_of: dict[int, bool] = {}
        self.param_storages: dict[int, int] = {}
        self.on_param_read: Callable[[int], None] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.on_param_read is not None:
            self._report_param_reads((*args, *kwargs.values()))
        if func is _SCALAR and args[0].is_meta:
            return self._assumed_scalar(args[0])
        key = self._op_cache.key(func, args, kwargs)
        hit = self._op_cache.get(key)
        if hit is not None:
            out, op_flops = hit
        else:
            out = func(*args, **kwargs)
            op_flops = self._flops(func, args, kwargs, out)
            self._op_cache.remember(key, args, out, op_flops)
        self.pointwise_bytes += pointwise_bytes(func, out)
        if op_flops:
            self.flops += op_flops
            if self.block is not None and not self.in_backward:
                self.block_fwd_flops[self.block] += op_flops
        if func._overloadpacket in _REDUCTIONS_TO_BOOL:
            # Models branch on data (`if (mask == 0).all()`); a meta tensor has none. Assume the
            # usual training batch: every all() holds, no any() does (no padding, no NaN).
            self._bool_of[out.untyped_storage()._cdata] = func._overloadpacket is torch.ops.aten.all
        if isinstance(out, torch.Tensor):
            self._track(out)
        elif isinstance(out, (tuple, list)):  # aten ops return a tensor or a flat sequence
            for tensor in out:
                if isinstance(tensor, torch.Tensor):
                    self._track(tensor)
        return out

    def _report_param_reads(self, values: tuple) -> None:
        """Reports the parameters among an op's arguments (tensor lists included), by storage."""
        assert self.on_param_read is not None  # checked by the caller
        for value in values:
            items = value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if isinstance(item, torch.Tensor) and item.layout == torch.strided:
                    pos = self.param_storages.get(item.untyped_storage()._cdata)
                    if pos is not None:
                        self.on_param_read(pos)

    def _flops(self, func, args, kwargs, out) -> float:
        formula = self._registry.get(func._overloadpacket)
        if formula is None:
            return 0.0
        try:
            return float(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not know this overload: count nothing
            return 0.0

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live or key in self._known:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key, 0)
        self._bool_of.pop(key, None)

    def _assumed_scalar(self, tensor: torch.Tensor):
        if tensor.dtype == torch.bool:
            return self._bool_of.get(tensor.untyped_storage()._cdata, False)
        return 1.0 if tensor.is_floating_point() else 1
