"""The multi-process part of the probe: one process per device, all measuring at the same time.

`run_workers` starts ``world_size`` copies of this module (``python -m
elixir_tune.hardware.workers CONFIG``) with a TCP rendezvous on a free local port and a hard
timeout. Each worker measures:
- all-gather and reduce-scatter bus bandwidth over sizes (gloo on CPU, NCCL on GPUs), with the
  nccl-tests conventions: algbw = total bytes / time, busbw = algbw * (n - 1) / n, the time being
  the slowest rank's;
- on CPU, the host copy curve with every process copying at once (the CPU's "h2d_gbps_all");
- the CPU Adam rate with the threads one rank gets, all ranks stepping at once as in training;
- on CPU, a transformer block's forward+backward rate over sizes, all ranks computing at once as
  in training (they share the cores' caches and the memory bandwidth), and what a tiny collective
  costs between such blocks (``_loaded_latency_s``).
Every rank writes its results as JSON; the launcher merges them.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elixir_tune.cpu_binding import binding_preexec
from elixir_tune.device import ops_for
from elixir_tune.hardware.timing import median_paired_extra_s

# torch >= 2.13 renamed the tensor collectives; the old names still work there but warn.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _collective_time_s(op, device: torch.device, budget_s: float, max_iters: int = 20) -> float:
    """Mean time of ``op`` over a loop (nccl-tests style), the slowest rank's, agreed by all."""
    for _ in range(2 if device.type == "cuda" else 1):
        op()  # warm-up: connection setup, NCCL channel buffers
    ops_for(device).synchronize()
    dist.barrier()
    begin = time.perf_counter()
    op()
    ops_for(device).synchronize()
    estimate = torch.tensor([time.perf_counter() - begin], dtype=torch.float64, device=device)
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
    iters = int(min(max_iters, max(2, budget_s / max(estimate.item(), 1e-6))))
    dist.barrier()
    begin = time.perf_counter()
    for _ in range(iters):
        op()
    ops_for(device).synchronize()
    elapsed = torch.tensor([(time.perf_counter() - begin) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _collective_curves(device: torch.device, sizes_bytes: list[int], budget_s: float) -> dict:
    world = dist.get_world_size()
    allgather, reduce_scatter = {}, {}
    rs_impl = "reduce_scatter_tensor"
    per_op_s = budget_s / (2 * len(sizes_bytes) + 1)
    # Latency: an all-gather of 256 fp32 elements per rank, where bandwidth plays no part.
    tiny_shard = torch.ones(256, dtype=torch.float32, device=device)
    tiny_full = torch.ones(256 * world, dtype=torch.float32, device=device)
    latency_s = _collective_time_s(lambda: _all_gather_tensor(tiny_full, tiny_shard), device, per_op_s, max_iters=200)
    for size in sizes_bytes:
        count = max(world, size // 4 // world * world)  # fp32 elements, divisible by world
        full = torch.ones(count, dtype=torch.float32, device=device)
        shard = torch.ones(count // world, dtype=torch.float32, device=device)
        total_bytes = count * 4
        seconds = _collective_time_s(functools.partial(_all_gather_tensor, full, shard), device, per_op_s)
        allgather[total_bytes] = total_bytes / seconds / 1e9 * (world - 1) / world
        try:
            seconds = _collective_time_s(functools.partial(_reduce_scatter_tensor, shard, full), device, per_op_s)
        except (RuntimeError, NotImplementedError):
            # Old gloo builds lack reduce-scatter; an all-reduce is what a gloo engine falls
            # back to, so that is the time a reduce-scatter costs there.
            rs_impl = "all_reduce (no gloo reduce_scatter in this torch)"
            seconds = _collective_time_s(functools.partial(dist.all_reduce, full), device, per_op_s)
        reduce_scatter[total_bytes] = total_bytes / seconds / 1e9 * (world - 1) / world
        del full, shard
    return {
        "allgather": allgather,
        "reduce_scatter": reduce_scatter,
        "latency_s": latency_s,
        "reduce_scatter_impl": rs_impl,
    }


def _loaded_latency_s(device: torch.device, shape: tuple[int, int, int, int], budget_s: float) -> float:
    """What a tiny all-gather adds to a block's forward+backward when it runs between blocks.

    Back to back, a collective finds its peers waiting and its threads awake (the idle latency).
    In training it comes after compute: the ranks arrive apart and on the CPU gloo's threads must
    win a core back from compute. Every rank runs pairs at once: the block alone, then the block and
    a 1 KiB all-gather. On each rank the cost is the median of its pairs' differences
    (``timing.median_paired_extra_s``: a change of the machine's load between pairs cancels out of
    each difference, where it did not out of the difference of the two medians, which moved the quick
    probe's figure 1.4-3.9 ms from probe to probe); the figure is the largest rank's, as before: the
    rank that arrives first waits for the other, and that wait is part of what a collective costs
    between compute.
    """
    from elixir_tune.hardware.bench_compute import ProbeBlock

    world = dist.get_world_size()
    batch, seq, hidden, heads = shape
    block = ProbeBlock(hidden, heads).to(device)
    x = torch.randn(batch, seq, hidden, device=device, requires_grad=True)
    shard = torch.ones(256, device=device)
    full = torch.ones(256 * world, device=device)

    def compute() -> None:
        block(x).sum().backward()

    def compute_then_gather() -> None:
        compute()
        _all_gather_tensor(full, shard)

    # Every rank must run the same number of collectives: the count comes from the slowest rank's
    # first pair, agreed by all (a count from each rank's own clock once left one rank in a barrier
    # while the other was already past it, and gloo aborted).
    begin = time.perf_counter()
    compute()
    compute_then_gather()
    pair_s = torch.tensor([time.perf_counter() - begin], dtype=torch.float64)
    dist.all_reduce(pair_s, op=dist.ReduceOp.MAX)
    pairs = int(min(200, max(5, budget_s / pair_s.item())))
    times: dict[str, list[float]] = {"alone": [], "gather": []}
    for _ in range(pairs):
        for name, fn in (("alone", compute), ("gather", compute_then_gather)):
            dist.barrier()
            begin = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - begin)
    extra = torch.tensor([median_paired_extra_s(times["alone"], times["gather"])], dtype=torch.float64)
    dist.all_reduce(extra, op=dist.ReduceOp.MAX)
    return extra.item()


def worker_main(config: dict) -> None:
    """One probe worker: join the group, measure, write rank<r>.json into config["out_dir"]."""
    from elixir_tune.hardware.bench_compute import adam_elems_per_s, block_rates
    from elixir_tune.hardware.bench_copy import host_copy_curve

    rank, world = config["rank"], config["world_size"]
    phases_s: dict[str, float] = {}  # where the time went, for `sources`-level diagnosis
    clock = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases_s[name] = round(now - clock, 3)
        clock = now

    torch.set_num_threads(config["threads"])
    if config["device"] == "cuda":
        ops_for(torch.device("cuda", rank)).set_device()
        device, backend = torch.device("cuda", rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{config['port']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=config["timeout_s"]),
    )
    phase("init")
    try:
        result = {"rank": rank, "backend": backend, "threads": config["threads"]}
        result.update(_collective_curves(device, config["sizes_bytes"], config["budget_s"]))
        phase("collectives")
        if config["device"] == "cpu":
            dist.barrier()
            result["host_copy_all"] = host_copy_curve(config["copy_sizes_bytes"], config["budget_s"] / 2)
            phase("host_copies")
        dist.barrier()
        rate, impl = adam_elems_per_s(torch.device("cpu"), config["adam_elements"], config["budget_s"] / 2)
        result["cpu_adam_elems_per_s"], result["cpu_adam_impl"] = rate, impl
        dist.barrier()
        phase("cpu_adam")
        if config.get("block_shapes"):
            dist.barrier()
            shapes = [tuple(shape) for shape in config["block_shapes"]]
            curve, overhead_s, rate_gbps = block_rates(device, "fp32", shapes, 3 * config["budget_s"])
            result["block_curve"], result["block_overhead_s"], result["pointwise_gbps"] = curve, overhead_s, rate_gbps
            dist.barrier()
            phase("blocks")
            result["loaded_latency_s"] = _loaded_latency_s(device, shapes[0], config["budget_s"])
            phase("loaded_latency")
        if config.get("layout_ratios"):
            from elixir_tune.hardware.bench_layout import layout_ratios

            result["layout"] = layout_ratios(repeats=config["layout_repeats"])
            phase("layout_ratios")
    finally:
        dist.destroy_process_group()
    result["phases_s"] = phases_s
    Path(config["out_dir"], f"rank{rank}.json").write_text(json.dumps(result))


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Waits until every worker exited, one failed (the others would wait for it), or time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc in procs]
        if all(code is not None for code in codes) or any(code not in (None, 0) for code in codes):
            return
        time.sleep(0.05)


def supervise(procs: list[subprocess.Popen], log_paths: list[Path], timeout_s: float, what: str) -> None:
    """Waits for the workers, kills those still running when one failed or time is up, and raises for
    the worker that failed by itself (not one stopped because of it).

    Args:
        procs: the workers, by rank.
        log_paths: each worker's combined stdout/stderr, by rank.
        timeout_s: hard limit.
        what: names the workers in the error, e.g. "probe worker".

    Raises:
        RuntimeError: a worker failed or timed out (the message carries its log's tail).
    """
    killed = set()
    try:
        _wait_all(procs, timeout_s)
    finally:
        for rank, proc in enumerate(procs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                killed.add(rank)
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0 and rank not in killed]
    if failed or killed:
        rank = failed[0] if failed else min(killed)
        reason = f"exited with status {procs[rank].returncode}" if failed else f"timed out after {timeout_s:.0f} s"
        tail = log_paths[rank].read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{what} {rank} of {len(procs)} {reason}:\n{tail}")


def run_workers(
    device: str,
    world_size: int,
    threads: int,
    sizes_bytes: list[int],
    copy_sizes_bytes: list[int],
    adam_elements: int,
    budget_s: float,
    timeout_s: float,
    block_shapes: list[tuple[int, int, int, int]] | None = None,
    layout_repeats: int = 0,
) -> dict:
    """Runs ``world_size`` probe workers and merges what they measured.

    Args:
        device: "cuda" (one worker per GPU, NCCL) or "cpu" (gloo).
        world_size: processes to start.
        threads: CPU threads each worker uses (the cores one rank gets).
        sizes_bytes: total collective buffer sizes to measure.
        copy_sizes_bytes: host copy sizes (cpu only).
        adam_elements: elements per CPU Adam step.
        budget_s: time each worker spends measuring, roughly.
        timeout_s: hard limit; workers still running then are killed.
        block_shapes: (batch, seq, hidden, heads) of the fp32 block-rate curve (cpu), or None.
        layout_repeats: cpu, 2 workers: rounds of the layout ratios (``bench_layout``); 0: none.

    Returns:
        {"allgather": {bytes: busbw GB/s}, "reduce_scatter": {...}, "latency_s": float (a tiny
        all-gather), with block shapes also "block_curve", "block_overhead_s", "pointwise_gbps" and
        "loaded_latency_s" (a tiny all-gather between blocks), with layout repeats "layout"
        (``bench_layout.layout_ratios``, already the slowest rank's),
        "reduce_scatter_impl": str, "host_copy_all": {bytes: GB/s per process} (cpu),
        "cpu_adam_elems_per_s": float (mean over ranks), "cpu_adam_impl": str, "backend": str}.

    Raises:
        RuntimeError: a worker failed or timed out (the message carries its stderr tail).
    """
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="elixir-probe-") as out_dir:
        procs, log_paths = [], []
        for rank in range(world_size):
            config = {
                "rank": rank,
                "world_size": world_size,
                "port": port,
                "device": device,
                "threads": threads,
                "sizes_bytes": sizes_bytes,
                "copy_sizes_bytes": copy_sizes_bytes,
                "adam_elements": adam_elements,
                "budget_s": budget_s,
                "timeout_s": timeout_s,
                "out_dir": out_dir,
                "block_shapes": block_shapes,
                "layout_ratios": layout_repeats > 0 and device == "cpu" and world_size == 2,
                "layout_repeats": layout_repeats,
            }
            log_paths.append(Path(out_dir, f"rank{rank}.log"))
            with open(log_paths[-1], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "elixir_tune.hardware.workers", json.dumps(config)],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        # CPU workers on cores of their own, as elixir-run binds a CPU plan's workers.
                        preexec_fn=binding_preexec(rank, world_size) if device == "cpu" else None,
                    )
                )
        supervise(procs, log_paths, timeout_s, f"probe worker ({device})")
        results = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]
    return _merge(results)


def _merge(results: list[dict]) -> dict:
    def int_keys(curve: dict) -> dict[int, float]:
        return {int(size): value for size, value in curve.items()}

    first = results[0]  # collective times are already the slowest rank's on every rank
    merged: dict[str, Any] = {key: int_keys(first[key]) for key in ("allgather", "reduce_scatter")}
    merged["latency_s"] = first["latency_s"]
    merged["reduce_scatter_impl"] = first["reduce_scatter_impl"]
    merged["backend"] = first["backend"]
    merged["phases_s"] = first["phases_s"]
    if "host_copy_all" in first:
        sizes = int_keys(first["host_copy_all"])
        merged["host_copy_all"] = {
            size: statistics.fmean(int_keys(r["host_copy_all"])[size] for r in results) for size in sizes
        }
    merged["cpu_adam_elems_per_s"] = statistics.fmean(r["cpu_adam_elems_per_s"] for r in results)
    if "block_curve" in first:
        merged["block_curve"] = {
            numel: statistics.fmean(int_keys(r["block_curve"])[numel] for r in results)
            for numel in int_keys(first["block_curve"])
        }
        for key in ("block_overhead_s", "pointwise_gbps"):
            merged[key] = statistics.fmean(r[key] for r in results)
        merged["loaded_latency_s"] = first["loaded_latency_s"]  # already the slowest rank's
    if "layout" in first:
        merged["layout"] = first["layout"]
    merged["cpu_adam_impl"] = first["cpu_adam_impl"]
    return merged


if __name__ == "__main__":
    from elixir_tune.worker_exit import exit_worker

    worker_main(json.loads(sys.argv[1]))
    exit_worker(0)  # the results are written: no C++ teardown to abort in (elixir_tune/worker_exit.py)
