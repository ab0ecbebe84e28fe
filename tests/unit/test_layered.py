"""The machinery of layered accumulation (engine/layered.py) on plain modules, without the engine:
layer-major forward through the baton, layer-major backward from the autograd engine's ordering,
one gradient accumulation per parameter, the caller's grad mode and autocast in the threads, and
an exception in one micro-batch raised in the caller without a deadlock, and the micro-batch threads
kept from one step to the next."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from elixir_tune.engine.layered import Baton, MicroBatchThreads, run_layer_major

LAYERS = 3
COUNT = 4


class Holder:
    """What the engine does: the current step's baton, seen by every module's pre-hook."""

    def __init__(self):
        self.baton: Baton | None = None

    def set(self, baton: Baton | None) -> None:
        self.baton = baton


def hooked_net(holder: Holder, forward_log: list, backward_log: list) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(LAYERS)])
    for layer, module in enumerate(net):

        def pre(mod, args, layer=layer):
            if holder.baton is not None:
                holder.baton.boundary()
            forward_log.append(layer)

        def post(mod, args, output, layer=layer):
            if output.requires_grad:
                output.register_hook(lambda grad, layer=layer: backward_log.append(layer))

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    return net


def test_forward_and_backward_run_layer_major():
    holder, forward_log, backward_log = Holder(), [], []
    net = hooked_net(holder, forward_log, backward_log)
    inputs = [torch.randn(2, 8, generator=torch.Generator().manual_seed(i)) for i in range(COUNT)]
    accumulations = []
    for param in net.parameters():
        param.register_post_accumulate_grad_hook(lambda p: accumulations.append(p))

    losses = run_layer_major(lambda i: net(inputs[i]).pow(2).mean() / COUNT, COUNT, holder.set, MicroBatchThreads())
    assert forward_log == [layer for layer in range(LAYERS) for _ in range(COUNT)]
    torch.autograd.backward(losses)
    # Reverse layer by layer: every micro-batch's layer k before any micro-batch's layer k-1.
    assert backward_log == [layer for layer in reversed(range(LAYERS)) for _ in range(COUNT)]
    # The autograd engine sums the micro-batches' gradients before accumulating once.
    assert len(accumulations) == len(list(net.parameters()))
    layered = [p.grad.clone() for p in net.parameters()]

    net.zero_grad()
    for i in range(COUNT):
        (net(inputs[i]).pow(2).mean() / COUNT).backward()
    for got, want in zip(layered, (p.grad for p in net.parameters()), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert holder.baton is None  # cleared after the step


def test_threads_take_grad_mode_and_autocast():
    holder = Holder()
    net = hooked_net(holder, [], [])
    x = torch.randn(2, 8)
    threads = MicroBatchThreads()
    with torch.no_grad():
        outputs = run_layer_major(lambda i: net(x), 2, holder.set, threads)
    assert all(out.grad_fn is None for out in outputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the same threads, now under autocast
        outputs = run_layer_major(lambda i: net(x), 2, holder.set, threads)
    assert all(out.dtype == torch.bfloat16 and out.grad_fn is not None for out in outputs)


def test_an_exception_in_one_micro_batch_is_raised_without_deadlock():
    holder, forward_log = Holder(), []
    net = hooked_net(holder, forward_log, [])

    def forward_loss(index: int) -> torch.Tensor:
        out = net[0](torch.randn(2, 8))
        if index == 1:
            raise KeyError("micro-batch 1 has no labels")
        return net[2](net[1](out)).sum()

    threads = MicroBatchThreads()
    with pytest.raises(KeyError, match="micro-batch 1 has no labels"):
        run_layer_major(forward_loss, COUNT, holder.set, threads)
    # The others stopped at their next layer: nobody ran layer 2.
    assert 2 not in forward_log
    assert holder.baton is None
    # The threads are free again: the next step runs on them.
    losses = run_layer_major(lambda i: net(torch.randn(2, 8)).sum(), COUNT, holder.set, threads)
    assert len(losses) == COUNT


def test_the_threads_are_kept_across_steps():
    holder = Holder()
    net = hooked_net(holder, [], [])
    threads = MicroBatchThreads()
    seen: list[set[int]] = []

    def step(count: int) -> None:
        idents: set[int] = set()

        def forward_loss(index: int) -> torch.Tensor:
            idents.add(threading.get_ident())
            return net(torch.randn(2, 8)).sum()

        run_layer_major(forward_loss, count, holder.set, threads)
        seen.append(idents)

    step(COUNT)
    step(COUNT)
    assert len(seen[0]) == COUNT and seen[1] == seen[0]
    step(COUNT + 2)  # more micro-batches than threads: a larger pool, every micro-batch its own thread
    assert len(seen[2]) == COUNT + 2
    threads.close()


def test_the_baton_ignores_threads_outside_the_step():
    baton = Baton(2)
    baton.boundary()  # the caller's own thread (e.g. a recomputation in backward): returns at once
    assert baton.segment == [0, 0]
