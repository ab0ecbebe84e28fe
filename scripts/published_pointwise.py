"""Pointwise traffic per layer of two transformers models, counted on the meta device.

The figures the GPU presets' pointwise terms are derived from (configs/hardware/*.yaml,
``pointwise_gbps`` and ``rate_pointwise_elems``): for transformers' GPT-2 as the Colossal-AI
benchmarks ran it (eager attention, tanh-GELU written op by op, dropout 0.1) and for MPT as
llm-foundry runs it (transformers' ``mpt``: no biases, exact GELU in one op, no dropout), the
bytes that ``elixir_tune.pointwise`` counts per layer, split into ops whose output is a seq x seq
score tensor (which ``rates.attention_scores_bytes`` prices for an eager attention, and which a
fused attention never writes) and the rest, and the bytes those ops read per byte they write. A
layer's figure is the difference of a 2-layer and a 1-layer model (embedding, head and loss cancel).

    python scripts/published_pointwise.py            # hidden 1600, 25 heads, seq 1024, fp16
    python scripts/published_pointwise.py --cpu-check  # the count against a timed run on this CPU

``--cpu-check`` times transformers' GPT-2 (fp32, real tensors, one process on one thread, CPU time) with its GELU written
op by op ("gelu_new") and as one op ("gelu_pytorch_tanh"), alternating, and sets the measured time
difference beside the difference of the two models' counted pointwise bytes at the ``cpu``
preset's ``pointwise_gbps``.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from elixir_tune.pointwise import pointwise_bytes


class SplitCounter(TorchDispatchMode):
    """``pointwise_bytes`` of each op, split by whether its output is seq x seq, and the bytes it read."""

    def __init__(self, seq_len: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.written: collections.Counter[str] = collections.Counter()
        self.read: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        written = pointwise_bytes(func, out)
        if written:
            first = out[0] if isinstance(out, (tuple, list)) else out
            kind = "scores" if first.dim() >= 2 and first.shape[-2:] == (self.seq_len, self.seq_len) else "other"
            self.written[kind] += written
            # Scalars and broadcast constants are not traffic.
            self.read[kind] += sum(
                t.numel() * t.element_size()
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.numel() > 1
            )
        return out


def build(family: str, hidden: int, heads: int, layers: int, seq_len: int) -> torch.nn.Module:
    """The model on the meta device in fp16, in training mode."""
    from transformers import GPT2Config, GPT2LMHeadModel, MptConfig, MptForCausalLM

    with torch.device("meta"):
        if family == "gpt2":
            config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq_len)
            model = GPT2LMHeadModel._from_config(config, attn_implementation="eager", dtype=torch.float16)
        else:
            config = MptConfig(d_model=hidden, n_heads=heads, n_layers=layers, max_seq_len=seq_len, no_bias=True,
                               resid_pdrop=0.0, emb_pdrop=0.0)  # fmt: skip
            model = MptForCausalLM._from_config(config, dtype=torch.float16)
    return model.train()


def count(family: str, hidden: int, heads: int, layers: int, seq_len: int) -> SplitCounter:
    """One sample's forward+backward under the counter."""
    model = build(family, hidden, heads, layers, seq_len)
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    with SplitCounter(seq_len) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter


def cpu_check(hidden: int = 256, layers: int = 4, heads: int = 4, seq_len: int = 256, batch: int = 4) -> None:
    """Prints measured (CPU time, one thread) and predicted seconds of the unfused GELU's extra pointwise work on this CPU."""
    import statistics
    import time

    from transformers import GPT2Config, GPT2LMHeadModel

    from elixir_tune.hardware import load_hardware
    from elixir_tune.pointwise import PointwiseCounter

    # One thread and CPU time, not wall time: the preset's rate is one process's (of 2 on 2 cores),
    # and CPU time does not count the waits of a shared machine.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (batch, seq_len))
    models, counted = {}, {}
    for activation in ("gelu_new", "gelu_pytorch_tanh"):
        config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq_len, vocab_size=1000,
                            activation_function=activation)  # fmt: skip
        model = GPT2LMHeadModel._from_config(config, attn_implementation="eager").train()
        with PointwiseCounter() as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        models[activation], counted[activation] = model, counter.bytes
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(12):
        for name, model in models.items():
            started = time.process_time()
            model(input_ids=ids, labels=ids).loss.backward()
            times[name].append(time.process_time() - started)
    median = {name: statistics.median(values[2:]) for name, values in times.items()}
    extra_bytes = counted["gelu_new"] - counted["gelu_pytorch_tanh"]
    rate_gbps = load_hardware("cpu").pointwise_gbps
    print(f"median step: unfused GELU {median['gelu_new']:.4f} s, one-op GELU {median['gelu_pytorch_tanh']:.4f} s "
          f"({median['gelu_new'] / median['gelu_pytorch_tanh']:.2f}x)")  # fmt: skip
    print(f"measured extra {median['gelu_new'] - median['gelu_pytorch_tanh']:.4f} s; counted extra "
          f"{extra_bytes / 2**20:.1f} MiB at the cpu preset's {rate_gbps} GB/s: {extra_bytes / rate_gbps / 1e9:.4f} s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1600)
    parser.add_argument("--heads", type=int, default=25)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--cpu-check", action="store_true", help="time the unfused GELU's extra work on this CPU")
    args = parser.parse_args()
    if args.cpu_check:
        cpu_check()
        return
    for family in ("gpt2", "mpt"):
        one, two = (count(family, args.hidden, args.heads, layers, args.seq_len) for layers in (1, 2))
        for kind in ("other", "scores"):
            written = two.written[kind] - one.written[kind]
            read = two.read[kind] - one.read[kind]
            if not written:
                continue
            elems = written / 2 / (args.seq_len * args.hidden)  # fp16: 2 bytes an element
            print(
                f"{family} {kind}: {written / 2**20:.1f} MiB written per layer and sample "
                f"({elems:.2f} elements per token and hidden unit), read/written {read / written:.2f}"
            )


if __name__ == "__main__":
    main()
