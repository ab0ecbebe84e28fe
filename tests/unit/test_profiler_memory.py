"""Activation memory measured on the meta device against a real CPU run of the same model.

The real run is measured independently with torch.profiler's memory events (every CPU
allocation and free, in time order); its peak must be within 10% of the profile's activation
line at that batch size, plain and with every block checkpointed.
"""

from pathlib import Path

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from elixir_tune.profiler import load_model_source, profile_model

MODELS = Path(__file__).parent / "models"


def real_peak_activation_bytes(source, batch_size: int, seq_len: int, checkpoint_blocks: bool) -> int:
    """Peak bytes allocated during one real forward+backward on the CPU, beyond what existed before."""
    torch.manual_seed(0)
    model = source.build_model().train()
    if checkpoint_blocks:
        for block in model.transformer.h:
            forward = block.forward
            block.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    # Like the engine, a finished gradient leaves at once (into its chunk): it is not activation memory.
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    batch = source.example_batch(batch_size, seq_len)
    model(**batch).loss.backward()  # warm-up: lazy initialisation is not activation memory
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(**batch).loss
        loss.backward()
        del loss
    allocations = []
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size))
    live = peak = 0
    for _, size in sorted(allocations):
        live += size
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("spec, batch_size, seq_len", [("gpt2-tiny", 6, 128), ("gpt2-tiny", 2, 64)])
def test_meta_activation_memory_matches_real_cpu_run(spec, batch_size, seq_len, checkpointed):
    source = load_model_source(spec)
    # Profiled at another batch size: the line must also predict the measured one.
    prof = profile_model(source, batch_size=4, seq_len=seq_len)
    line = prof.activation_checkpointed if checkpointed else prof.activation
    predicted = line.at(batch_size)
    measured = real_peak_activation_bytes(source, batch_size, seq_len, checkpointed)
    assert measured > 0
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)
