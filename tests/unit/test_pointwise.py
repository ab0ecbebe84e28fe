"""The pointwise-bytes rule (elixir_tune/pointwise.py): what counts, by hand-counted examples, and
the profiler's meta-device count equal to a real run's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from elixir_tune.hardware.bench_compute import tanh_gelu_unfused
from elixir_tune.pointwise import PointwiseCounter
from elixir_tune.profiler import load_model_source, profile_model

N = 1000


def counted(fn) -> int:
    with PointwiseCounter() as counter:
        fn()
    return counter.bytes


def test_elementwise_ops_count_their_output_bytes_and_nothing_else_does():
    x, w = torch.randn(N), torch.randn(10, 10)
    assert counted(lambda: x * 2) == 4 * N
    assert counted(lambda: torch.tanh(x)) == 4 * N
    assert counted(lambda: F.gelu(x, approximate="tanh")) == 4 * N
    assert counted(lambda: x.clone().add_(1)) == 2 * 4 * N  # the copy and the in-place add
    assert counted(lambda: x.to(torch.bfloat16) * 2) == 2 * N  # a cast is not tagged pointwise; bf16 output
    assert counted(lambda: x.view(10, 100)) == 0  # a view writes nothing
    assert counted(lambda: w @ w) == 0  # a matmul is priced by its FLOPs
    assert counted(lambda: x.sum()) == 0  # a reduction is not pointwise


def test_an_unfused_tanh_gelu_writes_eight_tensors_in_forward():
    x = torch.randn(N)
    with torch.no_grad():
        # pow, x 0.044715, + x, x sqrt(2/pi), tanh, + 1, 0.5 x x, x: eight ops over the whole tensor
        assert counted(lambda: tanh_gelu_unfused(x)) == 8 * 4 * N
        assert counted(lambda: F.gelu(x, approximate="tanh")) == 4 * N  # the fused one writes once


def test_the_profile_counts_what_a_real_forward_and_backward_writes():
    """GPT-2's causal attention runs fused on the CPU as on meta. (The profile counts attention as
    a fused kernel, as its memory does: a model whose attention the CPU runs op by op, such as a
    masked grouped-query Llama, writes more there than the profile says.)"""
    source = load_model_source("configs/models/gpt2-tiny.yaml")
    profile = profile_model(source, batch_size=2, seq_len=32)
    torch.manual_seed(0)
    real = source.build_model()
    batch = source.example_batch(2, 32)
    with PointwiseCounter() as counter:
        real(**batch).loss.backward()
    assert profile.pointwise_bytes_per_sample == counter.bytes / 2 > 0
    assert profile.recompute_pointwise_bytes_per_sample > 0  # the blocks' forwards run again
