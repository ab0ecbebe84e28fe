"""The live-storage meter and the meta op cache on small hand-made graphs."""

import torch

from elixir_tune.profiler.meter import LiveMemoryMeter
from elixir_tune.profiler.op_cache import MetaOpCache


def test_meter_follows_saved_tensors_views_and_frees():
    x = torch.empty(256, device="meta", requires_grad=True)  # 1 KiB, exists before: not counted
    with LiveMemoryMeter([x]) as meter:
        y = x.sin()  # saves x (not new) for backward; y is new
        z = y.cos()  # saves y; z is new
        view = z.view(16, 16)  # a view is not new memory
        assert meter.live_bytes == 2048
        del y, z
        assert meter.live_bytes == 2048  # y is saved by cos, view keeps z's storage
        loss = view.sum()
        loss.backward()
        del loss, view
    assert x.grad is not None  # the only survivor is the gradient
    assert meter.live_bytes == x.grad.untyped_storage().nbytes()
    assert meter.peak_bytes >= 3 * 1024
    assert meter.flops == 0  # elementwise ops count no FLOPs


def test_meter_counts_matmul_flops():
    a = torch.empty(8, 16, device="meta")
    b = torch.empty(16, 4, device="meta")
    with LiveMemoryMeter() as meter:
        a @ b
    assert meter.flops == 2 * 8 * 16 * 4


def test_meta_branches_assume_a_plain_batch():
    mask = torch.empty(4, dtype=torch.bool, device="meta")
    with LiveMemoryMeter():
        assert bool(mask.all()) is True
        assert bool(mask.any()) is False


def test_op_cache_rebuilds_same_outputs_and_keeps_scalar_types_apart():
    cache = MetaOpCache()
    x = torch.empty(4, 6, dtype=torch.int64, device="meta")
    with LiveMemoryMeter(op_cache=cache):
        first = [x * 2, x * 2.0, x.t().contiguous(), torch.nn.functional.layer_norm(x.float(), (6,))]
        again = [x * 2, x * 2.0, x.t().contiguous(), torch.nn.functional.layer_norm(x.float(), (6,))]
    for a, b in zip(first, again, strict=True):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
        assert a.untyped_storage()._cdata != b.untyped_storage()._cdata
    assert first[0].dtype == torch.int64 and first[1].dtype == torch.float32
    assert cache.get(cache.key(torch.ops.aten.mul.Tensor, (x, 2), {})) is not None
    assert cache.key(torch.ops.aten.add_.Tensor, (x, x), {}) is None  # mutating ops always run
