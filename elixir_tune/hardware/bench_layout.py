"""What tensor and pipeline layouts add to a block on the CPU, as ratios to the plain block's time.

Runs inside a process group of exactly 2 ranks (gloo; the probe's workers, or this module's own
launcher: ``python -m elixir_tune.hardware.bench_layout --repeats 3``). Every rank runs at once, as in
training, with the threads one rank gets. Three timings of one GPT-2 block (``ProbeBlock``):

* plain: the whole block's forward+backward on the whole batch, every rank at once (data parallel);
* tensor: the block split over both ranks as the engine splits a GPT-2 under 1D tensor parallelism
  with sequence parallelism (DTensors: norms on sequence shards, column-split ``qkv``/``up`` after an
  all-gather, row-split ``proj``/``down`` reduce-scattered back to sequence shards, the residual
  adds on DTensors), forward+backward of the same batch;
* pipeline: ``PIPELINE_BLOCKS`` blocks as as many virtual stages, 2 per rank, one step of torch's
  breadth-first looped schedule (``ScheduleLoopedBFS``, the engine's default) over
  ``MICRO_BATCHES`` micro-batches (``PipelineStage`` objects send activations and their gradients
  between the ranks), against the plain block's forward+backward of one micro-batch alone.

The machine may be shared with other work; ratios measured within one run are steadier than times,
so the results are ratios:

* ``tensor2_block_extra_ratio``: (tensor time - plain / 2) / plain: what the split adds beyond half
  the work (DTensor dispatch, the collectives, their waits, narrower matrices);
* ``pipeline_microbatch_extra_ratio``: (pipeline time - busy - bubble) / busy, where busy is
  M x (blocks per rank) x micro-batch time and the bubble one block's micro-batch: what the
  micro-batches' hand-overs and the schedule add, as a share of a stage's compute.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from elixir_tune.hardware.bench_compute import ProbeBlock

# (batch, seq, hidden, heads): a small GPT-2 block, the scale of the models a 2-core machine trains.
LAYOUT_SHAPE = (16, 64, 256, 4)
# A block so small that its times are mostly fixed costs (DTensor dispatch, the schedule's actions,
# sends and receives): with LAYOUT_SHAPE it separates a fixed cost from a share of the work.
TINY_SHAPE = (4, 8, 32, 2)
MICRO_BATCHES = 4
# Blocks of the pipeline, one virtual stage each: 2 per rank, as a 4-layer model's default split.
PIPELINE_BLOCKS = 4


class SplitProbeBlock(ProbeBlock):
    """ProbeBlock whose forward follows the width its ``qkv`` output has on this rank (a tensor
    rank holds a third of it per projection, and ``heads / degree`` heads)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv(self.ln_1(x))
        width = qkv.shape[-1] // 3
        head_dim = self.proj.in_features // self.heads
        q, k, v = (t.reshape(batch, -1, width // head_dim, head_dim).transpose(1, 2) for t in qkv.split(width, -1))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, -1, width))
        return x + self.down(F.gelu(self.up(self.ln_2(x)), approximate="tanh"))


def _interleaved_s(fns: dict[str, Callable[[], None]], repeats: int) -> list[dict[str, float]]:
    """Times every function once per round, in turn, every rank starting each together; per round
    the slowest rank's times. Interleaving keeps a change in the machine's load out of the ratios
    between them."""
    for fn in fns.values():
        fn()  # warm-up
    rounds = []
    for _ in range(repeats):
        times = []
        for fn in fns.values():
            dist.barrier()
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        rounds.append(dict(zip(fns, slowest.tolist(), strict=True)))
    return rounds


def _tensor_block(block: ProbeBlock, x: torch.Tensor) -> Callable[[], None]:
    """The forward+backward of ``block`` split over the 2 ranks, its input sequence-sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    styles = {
        "ln_1": SequenceParallel(),
        "qkv": ColwiseParallel(input_layouts=Shard(1)),
        "proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ln_2": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    parallelize_module(block, mesh, styles)
    local = x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].detach().requires_grad_()

    def run() -> None:
        out = block(DTensor.from_local(local, mesh, [Shard(1)]))
        out.to_local().sum().backward()

    return run


def _pipeline(hidden: int, heads: int, x: torch.Tensor, micro_batches: int) -> Callable[[], None]:
    """``PIPELINE_BLOCKS`` blocks as as many virtual stages over the 2 ranks (rank r holds stages r,
    r + 2, ...), one training step of torch's breadth-first looped schedule over ``micro_batches``
    (the engine's default pipeline schedule and stage objects)."""
    from torch.distributed import pipelining

    rank, ranks = dist.get_rank(), dist.get_world_size()
    micro = x[: x.shape[0] // micro_batches]
    example = torch.empty_like(micro).requires_grad_()
    stages: list[Any] = [
        pipelining.PipelineStage(
            SplitProbeBlock(hidden, heads),
            index,
            PIPELINE_BLOCKS,
            torch.device("cpu"),
            input_args=example,
            output_args=example,
        )
        for index in range(rank, PIPELINE_BLOCKS, ranks)
    ]
    schedule = pipelining.ScheduleLoopedBFS(
        stages, micro_batches, loss_fn=lambda out, target: (out * target).sum(), scale_grads=False
    )
    target = torch.ones_like(x)

    def run() -> None:
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=target)

    return run


def _times_at(shape: tuple[int, int, int, int]) -> dict[str, Callable[[], None]]:
    """The four timed functions of one block shape (module docstring)."""
    batch, seq, hidden, heads = shape
    torch.manual_seed(0)
    x = torch.randn(batch, seq, hidden)
    plain = SplitProbeBlock(hidden, heads)
    x_plain = x.clone().requires_grad_()
    micro = x[: batch // MICRO_BATCHES].clone().requires_grad_()
    return {
        "plain_block_s": lambda: plain(x_plain).sum().backward(),
        "micro_batch_s": lambda: plain(micro).sum().backward(),
        "pipeline2_s": _pipeline(hidden, heads, x, MICRO_BATCHES),
        "tensor2_block_s": _tensor_block(SplitProbeBlock(hidden, heads), x),
    }


# What the cost model reads of this benchmark (hardware/spec.py fields).
COSTS = (
    "tensor2_block_extra_ratio",
    "pipeline_microbatch_extra_ratio",
    "tensor2_block_fixed_s",
    "pipeline_stage_microbatch_s",
)
# Forward+backward calls of a virtual stage a rank makes in the pipeline step: 2 blocks per rank,
# each for every micro-batch.
STAGE_MICRO_BATCHES = MICRO_BATCHES * PIPELINE_BLOCKS // 2


def _shares(main: dict[str, float], tiny: dict[str, float]) -> dict[str, float]:
    """The fixed costs and the shares of one round, from the times at the main and the tiny shape.

    A tensor-split block takes ``fixed + (1/2 + ratio) x plain`` and a virtual stage's micro-batch
    in the pipeline ``fixed + (1 + ratio) x micro`` (the bubble, one micro-batch of one block,
    taken out first): two shapes, two unknowns each. Without a tiny shape (``tiny`` empty) the
    fixed costs are 0 and the ratios are the main shape's alone, as the probe measured them before.
    """

    def stage_s(times: dict[str, float]) -> float:
        return (times["pipeline2_s"] - times["micro_batch_s"]) / STAGE_MICRO_BATCHES

    plain_gap_s = main["plain_block_s"] - tiny.get("plain_block_s", 0.0)
    micro_gap_s = main["micro_batch_s"] - tiny.get("micro_batch_s", 0.0)
    if not tiny or plain_gap_s <= 0 or micro_gap_s <= 0:  # no tiny shape, or no smaller than the main one
        return {
            "tensor2_block_extra_ratio": (main["tensor2_block_s"] - main["plain_block_s"] / 2) / main["plain_block_s"],
            "pipeline_microbatch_extra_ratio": stage_s(main) / main["micro_batch_s"] - 1,
            "tensor2_block_fixed_s": 0.0,
            "pipeline_stage_microbatch_s": 0.0,
        }
    tensor_slope = (main["tensor2_block_s"] - tiny["tensor2_block_s"]) / plain_gap_s
    stage_slope = (stage_s(main) - stage_s(tiny)) / micro_gap_s
    return {
        "tensor2_block_extra_ratio": tensor_slope - 0.5,
        "pipeline_microbatch_extra_ratio": stage_slope - 1,
        "tensor2_block_fixed_s": tiny["tensor2_block_s"] - tensor_slope * tiny["plain_block_s"],
        "pipeline_stage_microbatch_s": stage_s(tiny) - stage_slope * tiny["micro_batch_s"],
    }


def layout_ratios(
    shape: tuple[int, int, int, int] = LAYOUT_SHAPE,
    repeats: int = 10,
    tiny_shape: tuple[int, int, int, int] | None = TINY_SHAPE,
) -> dict[str, float]:
    """Measures the layout costs in the current 2-rank process group (module docstring).

    Args:
        shape: (batch, seq, hidden, heads) of the block; batch divisible by ``MICRO_BATCHES``.
        repeats: rounds, each timing all four functions once at each shape.
        tiny_shape: the block whose times are mostly fixed costs; None: no fixed costs (0).

    Returns:
        The medians over the rounds of ``tensor2_block_extra_ratio``, ``pipeline_microbatch_extra_ratio``,
        ``tensor2_block_fixed_s``, ``pipeline_stage_microbatch_s`` (``COSTS``: each round's from that
        round's times, ``_shares``) and of the times (``plain_block_s``, ``tensor2_block_s``,
        ``micro_batch_s``, ``pipeline2_s``; the tiny shape's with a ``tiny_`` prefix); with more than
        one round also each cost's quartiles over the rounds (``<cost>_q1``, ``<cost>_q3``).

    Raises:
        ValueError: the group does not have 2 ranks.
    """
    if dist.get_world_size() != 2:
        raise ValueError(f"the layout ratios are measured at degree 2: the group has {dist.get_world_size()} ranks")
    fns = _times_at(shape)
    if tiny_shape is not None:
        fns.update({f"tiny_{key}": fn for key, fn in _times_at(tiny_shape).items()})
    rounds = _interleaved_s(fns, repeats)
    for times in rounds:
        main = {key: value for key, value in times.items() if not key.startswith("tiny_")}
        tiny = {key[len("tiny_") :]: value for key, value in times.items() if key.startswith("tiny_")}
        times.update(_shares(main, tiny))
    medians = {key: statistics.median(times[key] for times in rounds) for key in rounds[0]}
    if len(rounds) > 1:  # the spread of the costs the cost model reads, for the spec's sources
        for key in COSTS:
            q1, _, q3 = statistics.quantiles([times[key] for times in rounds], n=4, method="inclusive")
            medians[f"{key}_q1"], medians[f"{key}_q3"] = q1, q3
    return medians


def _worker(
    rank: int,
    init_file: str,
    rounds: int,
    shape: tuple[int, int, int, int],
    tiny_shape: tuple[int, int, int, int] | None,
    out_path: str,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    try:
        results = [layout_ratios(shape, tiny_shape=tiny_shape) for _ in range(rounds)]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as out:
            json.dump(results, out)
    from elixir_tune.worker_exit import exit_worker

    exit_worker(0)  # spawned worker, results written: no C++ teardown to abort in (elixir_tune/worker_exit.py)


def _parse_shape(parser: argparse.ArgumentParser, option: str, text: str) -> tuple[int, int, int, int]:
    """``batch,seq,hidden,heads`` as 4 integers the measurement can split, or the parser's error."""
    try:
        batch, seq, hidden, heads = (int(v) for v in text.split(","))
    except ValueError:
        parser.error(f"{option}: expected 4 integers batch,seq,hidden,heads, got {text!r}")
    if batch % MICRO_BATCHES or hidden % heads or heads % 2 or seq % 2:
        parser.error(f"{option} {text}: batch must divide by {MICRO_BATCHES}, hidden by heads, heads and seq by 2")
    return batch, seq, hidden, heads


def main(argv: list[str] | None = None) -> int:
    """Measures the layout costs ``--repeats`` times in 2 fresh processes of 1 thread each and
    prints every round and the medians as JSON."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="runs of layout_ratios, 10 rounds each")
    parser.add_argument(
        "--shape",
        default=",".join(map(str, LAYOUT_SHAPE)),
        help="batch,seq,hidden,heads of the block (batch divisible by 4, hidden by heads and by 2)",
    )
    parser.add_argument(
        "--tiny-shape",
        default=",".join(map(str, TINY_SHAPE)),
        help="the block of mostly fixed costs, the same format; 'none': no fixed costs (ratios alone)",
    )
    args = parser.parse_args(argv)
    shape = _parse_shape(parser, "--shape", args.shape)
    tiny_shape = None if args.tiny_shape == "none" else _parse_shape(parser, "--tiny-shape", args.tiny_shape)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="elixir-layout-") as tmp:
        out_path = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), args.repeats, shape, tiny_shape, out_path), nprocs=2)
        with open(out_path) as out:
            rounds = json.load(out)
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    json.dump({"rounds": rounds, "median": medians}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
