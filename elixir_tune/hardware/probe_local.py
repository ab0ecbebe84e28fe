"""`probe()`: measure this machine and describe it as a HardwareSpec.

With GPUs, device 0 is measured alone (memory, matmul, HBM copy, pinned copies, GPU Adam), all
GPUs together for the concurrent copies, and one worker process per GPU for NCCL collectives and
CPU Adam with the cores one rank gets. Without GPUs the CPU is the device: ``procs`` worker
processes share the host, each with cores/procs threads, and gloo carries the collectives, so
that CI gets a real spec to plan with.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import torch

from elixir_tune.hardware import host
from elixir_tune.hardware.bench_compute import adam_elems_per_s, block_rates, copy_gbps, matmul_tflops
from elixir_tune.hardware.bench_copy import (
    host_copy_curve,
    host_copy_latency_s,
    pinned_copy_curves,
    pinned_copy_curves_all,
    pinned_copy_latency_s,
)
from elixir_tune.hardware.spec import HardwareSpec
from elixir_tune.hardware.timing import GiB, MiB, asymptotic_gbps, size_ladder
from elixir_tune.hardware.workers import run_workers

Progress = Callable[[str], None] | None

DEFAULT_CPU_PROCS = 2
# NCCL over InfiniBand/RoCE reaches ~90% of the link; gloo/NCCL sockets over TCP much less.
_IB_EFFICIENCY, _ETHERNET_EFFICIENCY = 0.9, 0.6
_ASSUMED_ETHERNET_GBPS = 1.25  # 10 GbE when no link speed can be read


# Block shapes (batch, seq, hidden, heads) of the block-rate curve, small to large: a small model's
# blocks run far below the matmul rate (per-op overhead), a large one's near its model-level rate.
# On the CPU they span the demo's GPT-2 tiny (hidden 64) to GPT-2 small widths.
_CPU_BLOCKS = [(8, 128, 64, 4), (4, 128, 256, 4), (4, 128, 512, 8), (2, 256, 768, 12)]
_CUDA_BLOCKS = [(1, 1024, 1024, 16), (2, 1024, 2048, 16), (4, 1024, 4096, 32), (4, 2048, 6144, 48)]


_OVERHEAD_NOTE = "measured: forward+backward of a tiny block (batch 1, seq 8, hidden 64): per-call overhead"


class ProbeError(RuntimeError):
    """A measurement failed; the message says which and why."""


def _say(progress: Progress, message: str) -> None:
    if progress is not None:
        progress(message)


def probe(
    quick: bool = False, progress: Progress = None, procs: int | None = None, device: str | None = None
) -> HardwareSpec:
    """Measures the local machine.

    Args:
        quick: smaller sizes and fewer repeats (under ~30 s on a 2-core CPU machine).
        progress: called with a short description as each measurement starts.
        procs: worker processes when the CPU is the device (default 2); ignored with GPUs.
        device: "cuda" or "cpu" to force one; default cuda when available.

    Returns:
        A spec whose ``sources`` say how each number was measured.

    Raises:
        ProbeError: a measurement failed (e.g. the collective workers could not start).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ProbeError("device cuda requested but torch.cuda.is_available() is False")
    threads_before = torch.get_num_threads()
    try:
        if device == "cuda":
            return _probe_cuda(quick, progress)
        return _probe_cpu(quick, progress, procs or DEFAULT_CPU_PROCS)
    finally:
        torch.set_num_threads(threads_before)


def _versions() -> str:
    return f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"


def _inter_node_gbps(intra_gbps: float) -> tuple[float, str]:
    link_gbps, how = host.network_gbps()
    if "InfiniBand" in how:
        value, note = link_gbps * _IB_EFFICIENCY, f"{how} x {_IB_EFFICIENCY} (not measured)"
    elif link_gbps > 0:
        value, note = link_gbps * _ETHERNET_EFFICIENCY, f"{how} x {_ETHERNET_EFFICIENCY} (not measured)"
    else:
        value = _ASSUMED_ETHERNET_GBPS * _ETHERNET_EFFICIENCY
        note = f"assumed 10 GbE x {_ETHERNET_EFFICIENCY} ({how}; not measured)"
    return min(value, intra_gbps), "estimate: " + note + ", capped by the intra-node rate"


def _curve_summary(curve: dict[int, float]) -> str:
    sizes = sorted(curve)
    return f"{sizes[0] // MiB} MiB..{sizes[-1] // MiB} MiB"


def _asymptotic_note(curve: dict[int, float]) -> str:
    largest = max(curve)
    top = [size for size in sorted(curve) if size * 16 >= largest]
    return f"median over {top[0] // MiB}..{largest // MiB} MiB of sizes {_curve_summary(curve)} (bandwidth_curves)"


def _block_curves(
    device: torch.device,
    dtypes: list[str],
    shapes: list[tuple[int, int, int, int]],
    budget_s: float,
    progress: Progress,
) -> tuple[dict[str, dict[int, float]], float]:
    """Block forward+backward rate over ``shapes`` for each dtype (``bench_compute.block_rates``).

    Returns:
        (dtype -> {block parameters: TFLOP/s}, per-call overhead seconds of the first dtype).
    """
    curves: dict[str, dict[int, float]] = {}
    overheads: list[float] = []
    for dtype_name in dtypes:
        _say(progress, f"transformer block forward+backward {dtype_name}")
        try:
            curves[dtype_name], overhead_s = block_rates(device, dtype_name, shapes, budget_s)
        except RuntimeError:  # a dtype this device cannot run a block in
            continue
        overheads.append(overhead_s)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return curves, overheads[0] if overheads else 0.0


def _block_note(shapes: list[tuple[int, int, int, int]], how: str) -> str:
    sizes = ", ".join(f"{b}x{s}x{h}" for b, s, h, _ in shapes)
    return (
        f"measured: a GPT-2 block's forward+backward (batch x seq x hidden {sizes}), FLOPs from "
        f"torch.utils.flop_counter / (median time - block_call_overhead_s), keyed by the block's parameter count, {how}"
    )


def _run_collectives(
    device: str,
    procs: int,
    threads: int,
    coll_sizes: list[int],
    copy_sizes: list[int],
    adam_elements: int,
    budget_s: float,
    timeout_s: float,
    block_shapes: list[tuple[int, int, int, int]] | None = None,
) -> tuple[dict, float, float, str]:
    """Runs the multi-process benchmarks (collectives, concurrent copies, CPU Adam).

    Returns:
        (the workers' raw results, all-gather bus GB/s, reduce-scatter bus GB/s, a source note).
    """
    try:
        workers = run_workers(
            device,
            procs,
            threads,
            coll_sizes,
            copy_sizes,
            adam_elements,
            budget_s=budget_s,
            timeout_s=timeout_s,
            block_shapes=block_shapes,
        )
    except RuntimeError as error:
        raise ProbeError(str(error)) from None
    what = f"gloo, {procs} local processes" if device == "cpu" else f"NCCL, {procs} GPUs"
    note = f"measured: {what}, bus bandwidth (nccl-tests: algbw x (n-1)/n), {_asymptotic_note(workers['allgather'])}"
    return workers, asymptotic_gbps(workers["allgather"]), asymptotic_gbps(workers["reduce_scatter"]), note


def _probe_cpu(quick: bool, progress: Progress, procs: int) -> HardwareSpec:
    if procs < 1:
        raise ProbeError(f"procs must be at least 1, got {procs}")
    cpu = torch.device("cpu")
    cores = host.host_cores()
    threads = max(1, cores // procs)
    torch.set_num_threads(threads)
    memory_bytes, available_bytes = host.host_memory_bytes(), host.host_available_bytes()
    budget = 0.8 if quick else 3.0
    tokens, hidden = (512, 512) if quick else (1024, 768)
    how = f"{threads} thread(s) of {cores} core(s), {_versions()}"
    sources = {
        "device_name": "/proc/cpuinfo model name",
        "gpus_per_node": f"worker processes on this host (--procs {procs})",
        "gpu_memory_bytes": f"host RAM (MemTotal, cgroup-capped) / {procs} processes",
        "usable_memory_bytes": f"host MemAvailable at probe time / {procs} processes",
        "host_memory_bytes": "MemTotal (cgroup-capped)",
        "host_cores": "logical CPUs this process may use (affinity, cgroup quota)",
    }

    matmul: dict[str, float] = {}
    for dtype_name in ("fp32", "bf16", "fp16"):
        _say(progress, f"matmul {dtype_name} on the CPU ({threads} thread(s))")
        try:
            matmul[dtype_name] = matmul_tflops(cpu, dtype_name, tokens, hidden, budget)
        except RuntimeError:  # fp16 GEMM is missing on some CPU builds
            continue
    sources["matmul_tflops"] = (
        f"measured: F.linear on a transformer block's GEMMs (tokens "
        f"{tokens}, hidden {hidden}), median of repeats, {how}"
    )

    _say(progress, "memory copy bandwidth")
    copy_bytes = 64 * MiB if quick else 256 * MiB
    hbm = copy_gbps(cpu, copy_bytes, budget)
    sources["hbm_gbps"] = f"measured: torch copy_ of {copy_bytes // MiB} MiB, (read + write) bytes / s, {how}"

    _say(progress, "host copy bandwidth over sizes")
    copy_sizes = size_ladder(MiB, 64 * MiB if quick else GiB)
    h2d_curve = host_copy_curve(copy_sizes, 2 * budget)
    h2d = asymptotic_gbps(h2d_curve)
    latency = host_copy_latency_s(budget / 4)
    sources["h2d_gbps"] = sources["d2h_gbps"] = (
        f"measured: copy between two host buffers (the CPU is the device), one process alone, "
        f"{_asymptotic_note(h2d_curve)}, {how}"
    )
    sources["copy_latency_s"] = "measured: median time of one 4 KiB host copy (torch copy_)"
    curves = {"h2d_gbps": h2d_curve, "d2h_gbps": h2d_curve}

    # Larger than the last-level cache, as real shards are.
    adam_elements = 2**24 if quick else 2**25
    block_shapes = _CPU_BLOCKS[:3] if quick else _CPU_BLOCKS
    if procs > 1:
        _say(progress, f"gloo collectives, concurrent copies and CPU Adam in {procs} processes")
        coll_sizes = size_ladder(MiB, 32 * MiB if quick else GiB)
        workers, allgather_gbps, reduce_scatter_gbps, coll_note = _run_collectives(
            "cpu",
            procs,
            threads,
            coll_sizes,
            copy_sizes,
            adam_elements,
            budget_s=2 * budget,
            timeout_s=90 if quick else 300,
            block_shapes=block_shapes,
        )
        allgather, reduce_scatter = workers["allgather"], workers["reduce_scatter"]
        coll_latency = workers["latency_s"]
        copy_all = workers["host_copy_all"]
        h2d_all = asymptotic_gbps(copy_all)
        adam, adam_impl = workers["cpu_adam_elems_per_s"], workers["cpu_adam_impl"]
        sources["allgather_gbps"] = coll_note
        sources["reduce_scatter_gbps"] = coll_note + f", op {workers['reduce_scatter_impl']}"
        sources["collective_latency_s"] = "measured: gloo all-gather of 1 KiB per process"
        sources["h2d_gbps_all"] = sources["d2h_gbps_all"] = (
            f"measured: host copy in all {procs} processes at once, mean per process, {_asymptotic_note(copy_all)}"
        )
        sources["cpu_adam_elems_per_s"] = sources["gpu_adam_elems_per_s"] = (
            f"measured: torch.optim.AdamW ({adam_impl}) over {adam_elements} fp32 elements, all "
            f"{procs} processes stepping at once, {how}"
        )
        curves.update(
            {
                "h2d_gbps_all": copy_all,
                "d2h_gbps_all": copy_all,
                "allgather_gbps": allgather,
                "reduce_scatter_gbps": reduce_scatter,
            }
        )
    else:
        _say(progress, "CPU Adam")
        adam, adam_impl = adam_elems_per_s(cpu, adam_elements, budget)
        h2d_all = h2d
        allgather_gbps = reduce_scatter_gbps = hbm / 2
        coll_latency = latency
        single = "one process: no peers, a collective is a local copy (not measured)"
        sources.update(
            {
                "allgather_gbps": single,
                "reduce_scatter_gbps": single,
                "collective_latency_s": single,
                "h2d_gbps_all": "one process: same as h2d_gbps",
                "d2h_gbps_all": "one process: same as d2h_gbps",
                "cpu_adam_elems_per_s": f"measured: torch.optim.AdamW ({adam_impl}), {how}",
                "gpu_adam_elems_per_s": "same as cpu_adam_elems_per_s (the CPU is the device)",
            }
        )

    # fp32 only: a CPU's fp16 (and often bf16) blocks run at a few GFLOP/s and would take minutes;
    # the other dtypes' curves are fp32's scaled by their matmul rate. With several processes the
    # workers measured it all at once (they share caches and memory bandwidth, as in training).
    if procs > 1:
        block_curves, overhead_s = {"fp32": workers["block_curve"]}, workers["block_overhead_s"]
        block_how = f"all {procs} processes at once, {how}"
    else:
        block_curves, overhead_s = _block_curves(cpu, ["fp32"], block_shapes, 6 * budget, progress)
        block_how = how
    for dtype_name, tflops in matmul.items():
        if dtype_name != "fp32":
            ratio = tflops / matmul["fp32"]
            block_curves[dtype_name] = {numel: rate * ratio for numel, rate in block_curves["fp32"].items()}
    model_rates = {dtype: curve[max(curve)] for dtype, curve in block_curves.items()}
    sources["block_tflops_curves"] = (
        _block_note(block_shapes, block_how) + "; fp32 measured, other dtypes x their matmul rate / fp32's"
    )
    sources["model_tflops"] = "measured: the block rate at the largest shape (block_tflops_curves)"
    sources["block_call_overhead_s"] = _OVERHEAD_NOTE
    node_adam = adam * procs
    sources["cpu_adam_node_elems_per_s"] = "cpu_adam_elems_per_s x processes (measured all at once)"
    shared_link = False
    sources["shared_host_link"] = "the CPU is the device: no host link"
    inter_node, sources["inter_node_gbps"] = _inter_node_gbps(allgather_gbps)
    sources["allocator_overhead_bytes"] = "0: host allocations have no caching-allocator overhead"
    return HardwareSpec(
        name=f"probe of {socket.gethostname()} (cpu{', quick' if quick else ''})",
        device="cpu",
        device_name=host.cpu_name(),
        gpus_per_node=procs,
        gpu_memory_bytes=memory_bytes // procs,
        usable_memory_bytes=available_bytes // procs,
        matmul_tflops=matmul,
        hbm_gbps=hbm,
        h2d_gbps=h2d,
        d2h_gbps=h2d,
        h2d_gbps_all=h2d_all,
        d2h_gbps_all=h2d_all,
        allgather_gbps=allgather_gbps,
        reduce_scatter_gbps=reduce_scatter_gbps,
        inter_node_gbps=inter_node,
        gpu_adam_elems_per_s=adam,
        cpu_adam_elems_per_s=adam,
        host_memory_bytes=memory_bytes,
        host_cores=host.host_cores(),
        allocator_overhead_bytes=0,
        copy_latency_s=latency,
        collective_latency_s=coll_latency,
        sources=sources,
        bandwidth_curves=curves,
        model_tflops=model_rates,
        block_tflops_curves=block_curves,
        block_call_overhead_s=overhead_s,
        cpu_adam_node_elems_per_s=node_adam,
        shared_host_link=shared_link,
    )


def _probe_cuda(quick: bool, progress: Progress) -> HardwareSpec:
    num_gpus = torch.cuda.device_count()
    gpu = torch.device("cuda", 0)
    torch.cuda.set_device(gpu)
    cores = host.host_cores()
    budget = 0.5 if quick else 2.0
    how = _versions() + f", CUDA {torch.version.cuda}"
    sources = {
        "device_name": "torch.cuda.get_device_name(0)",
        "gpus_per_node": "torch.cuda.device_count()",
        "gpu_memory_bytes": "torch.cuda.get_device_properties(0).total_memory",
        "usable_memory_bytes": "measured: torch.cuda.mem_get_info free bytes once the CUDA context exists",
        "host_memory_bytes": "MemTotal (cgroup-capped)",
        "host_cores": "logical CPUs this process may use (affinity, cgroup quota)",
    }

    _say(progress, f"CUDA context on {torch.cuda.get_device_name(gpu)} ({num_gpus} GPU(s))")
    torch.zeros(1, device=gpu)  # creates the context
    torch.cuda.synchronize(gpu)
    torch.cuda.empty_cache()  # the tensor's cached block is not context
    free_after_context, _ = torch.cuda.mem_get_info(gpu)
    total = torch.cuda.get_device_properties(gpu).total_memory

    tokens, hidden = (4096, 4096) if quick else (8192, 4096)
    matmul: dict[str, float] = {}
    for dtype_name in ("fp32", "tf32", "bf16", "fp16"):
        _say(progress, f"matmul {dtype_name}")
        try:
            matmul[dtype_name] = matmul_tflops(gpu, dtype_name, tokens, hidden, budget)
        except RuntimeError:  # e.g. bf16 on a pre-Ampere GPU
            continue
    sources["matmul_tflops"] = (
        f"measured: F.linear on a transformer block's GEMMs (tokens "
        f"{tokens}, hidden {hidden}), CUDA events, median, {how}"
    )

    shapes = _CUDA_BLOCKS[:3] if quick else _CUDA_BLOCKS
    block_curves, overhead_s = _block_curves(gpu, ["bf16", "fp16", "fp32"], shapes, 2 * budget, progress)
    model_rates = {dtype: curve[max(curve)] for dtype, curve in block_curves.items()}
    sources["block_tflops_curves"] = _block_note(shapes, how)
    sources["model_tflops"] = "measured: the block rate at the largest shape (block_tflops_curves)"
    sources["block_call_overhead_s"] = _OVERHEAD_NOTE

    _say(progress, "HBM copy bandwidth")
    copy_bytes = 256 * MiB if quick else GiB
    hbm = copy_gbps(gpu, copy_bytes, budget)
    sources["hbm_gbps"] = f"measured: copy_ of {copy_bytes // MiB} MiB on GPU 0, (read + write) bytes / s"

    sizes = size_ladder(MiB, 256 * MiB if quick else GiB)
    _say(progress, "pinned host<->GPU copies, one GPU")
    h2d_curve, d2h_curve = pinned_copy_curves(0, sizes, 4 * budget)
    latency = pinned_copy_latency_s(0, budget / 4)
    note = f"measured: pinned copy, GPU 0 alone, CUDA events, {_asymptotic_note(h2d_curve)}"
    sources.update(
        {"h2d_gbps": note, "d2h_gbps": note, "copy_latency_s": "measured: pinned 4 KiB host->GPU copy, CUDA events"}
    )
    curves = {"h2d_gbps": h2d_curve, "d2h_gbps": d2h_curve}
    if num_gpus > 1:
        _say(progress, f"pinned host<->GPU copies, all {num_gpus} GPUs at once")
        h2d_all_curve, d2h_all_curve = pinned_copy_curves_all(num_gpus, sizes, 4 * budget)
        note = (
            f"measured: pinned copy on all {num_gpus} GPUs at once, per-GPU rate from the "
            f"wall time, {_asymptotic_note(h2d_all_curve)}"
        )
        curves.update({"h2d_gbps_all": h2d_all_curve, "d2h_gbps_all": d2h_all_curve})
    else:
        h2d_all_curve, d2h_all_curve = h2d_curve, d2h_curve
        note = "one GPU: same as alone"
    sources["h2d_gbps_all"] = sources["d2h_gbps_all"] = note

    _say(progress, "GPU Adam")
    adam_elements = 2**24 if quick else 2**26
    gpu_adam, gpu_impl = adam_elems_per_s(gpu, adam_elements, budget)
    sources["gpu_adam_elems_per_s"] = (
        f"measured: torch.optim.AdamW ({gpu_impl}) over {adam_elements} fp32 elements on GPU 0"
    )

    torch.cuda.empty_cache()
    torch.cuda.synchronize(gpu)
    free_now, _ = torch.cuda.mem_get_info(gpu)
    overhead = max(0, free_after_context - free_now)
    sources["allocator_overhead_bytes"] = (
        "measured: device memory the libraries keep after the "
        "benchmarks with no tensor alive (cuBLAS workspaces, "
        "lazily loaded kernels); fragmentation not included"
    )

    threads = max(1, cores // num_gpus)
    cpu_adam_elements = 2**24 if quick else 2**25  # larger than the last-level cache
    if num_gpus > 1:
        _say(progress, f"NCCL collectives and CPU Adam in {num_gpus} processes")
        coll_sizes = size_ladder(MiB, 256 * MiB if quick else GiB)
        workers, allgather_gbps, reduce_scatter_gbps, coll_note = _run_collectives(
            "cuda",
            num_gpus,
            threads,
            coll_sizes,
            [],
            cpu_adam_elements,
            budget_s=4 * budget,
            timeout_s=120 if quick else 600,
        )
        allgather, reduce_scatter = workers["allgather"], workers["reduce_scatter"]
        coll_latency = workers["latency_s"]
        cpu_adam, cpu_impl = workers["cpu_adam_elems_per_s"], workers["cpu_adam_impl"]
        sources.update(
            {
                "allgather_gbps": coll_note,
                "reduce_scatter_gbps": coll_note,
                "collective_latency_s": "measured: NCCL all-gather of 1 KiB per GPU",
                "cpu_adam_elems_per_s": (
                    f"measured: torch.optim.AdamW ({cpu_impl}) on the "
                    f"host, {threads} thread(s) per rank, all "
                    f"{num_gpus} ranks stepping at once"
                ),
            }
        )
        curves.update({"allgather_gbps": allgather, "reduce_scatter_gbps": reduce_scatter})
    else:
        _say(progress, "CPU Adam")
        torch.set_num_threads(threads)
        cpu_adam, cpu_impl = adam_elems_per_s(torch.device("cpu"), cpu_adam_elements, budget)
        allgather_gbps = reduce_scatter_gbps = hbm / 2
        coll_latency = 30e-6
        single = "one GPU: no peers, a collective is a local copy (not measured)"
        sources.update(
            {
                "allgather_gbps": single,
                "reduce_scatter_gbps": single,
                "collective_latency_s": "one GPU: default, not measured",
                "cpu_adam_elems_per_s": (f"measured: torch.optim.AdamW ({cpu_impl}) on the host, {threads} thread(s)"),
            }
        )

    # Per rank with every rank stepping at once (multi-GPU) or one process alone: x ranks is the node.
    node_adam = cpu_adam * num_gpus
    sources["cpu_adam_node_elems_per_s"] = (
        "cpu_adam_elems_per_s x GPUs (the per-rank rate was measured with all ranks at once)"
    )
    # No NVLink shows as collectives no faster than a host copy: NCCL then rides the same PCIe links.
    shared_link = num_gpus > 1 and allgather_gbps < 1.5 * asymptotic_gbps(h2d_curve)
    sources["shared_host_link"] = (
        f"derived: all-gather bus bandwidth {allgather_gbps:.1f} GB/s "
        f"{'<' if shared_link else '>='} 1.5 x host->GPU (PCIe) bandwidth"
        if num_gpus > 1
        else "one GPU: no collectives"
    )
    inter_node, sources["inter_node_gbps"] = _inter_node_gbps(allgather_gbps)
    return HardwareSpec(
        name=f"probe of {socket.gethostname()} (cuda{', quick' if quick else ''})",
        device="cuda",
        device_name=torch.cuda.get_device_name(gpu),
        gpus_per_node=num_gpus,
        gpu_memory_bytes=int(total),
        usable_memory_bytes=int(min(free_after_context, total)),
        matmul_tflops=matmul,
        hbm_gbps=hbm,
        h2d_gbps=asymptotic_gbps(h2d_curve),
        d2h_gbps=asymptotic_gbps(d2h_curve),
        h2d_gbps_all=asymptotic_gbps(h2d_all_curve),
        d2h_gbps_all=asymptotic_gbps(d2h_all_curve),
        allgather_gbps=allgather_gbps,
        reduce_scatter_gbps=reduce_scatter_gbps,
        inter_node_gbps=inter_node,
        gpu_adam_elems_per_s=gpu_adam,
        cpu_adam_elems_per_s=cpu_adam,
        host_memory_bytes=host.host_memory_bytes(),
        host_cores=cores,
        allocator_overhead_bytes=int(overhead),
        copy_latency_s=latency,
        collective_latency_s=coll_latency,
        sources=sources,
        bandwidth_curves=curves,
        model_tflops=model_rates,
        block_tflops_curves=block_curves,
        block_call_overhead_s=overhead_s,
        cpu_adam_node_elems_per_s=node_adam,
        shared_host_link=shared_link,
    )
