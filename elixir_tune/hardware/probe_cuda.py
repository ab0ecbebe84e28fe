"""GPUs as the device: device 0 alone, all GPUs for concurrent copies, one worker per GPU for NCCL."""

from __future__ import annotations

import socket

import torch

from elixir_tune.device import CudaOps, cuda_device_count
from elixir_tune.hardware import host
from elixir_tune.hardware.bench_compute import adam_elems_per_s, block_attention_fused, copy_gbps, matmul_tflops
from elixir_tune.hardware.bench_copy import (
    pinned_copy_curves,
    pinned_copy_curves_all,
    pinned_copy_latency_s,
)
from elixir_tune.hardware.probe_common import (
    CUDA_BLOCKS,
    Progress,
    asymptotic_note,
    block_note,
    block_sources,
    host_adam_sources,
    inter_node_gbps,
    measure_block_curves,
    run_collectives,
    say,
    versions,
)
from elixir_tune.hardware.spec import HardwareSpec
from elixir_tune.hardware.timing import GiB, MiB, asymptotic_gbps, size_ladder


def probe_cuda(quick: bool, progress: Progress) -> HardwareSpec:
    num_gpus = cuda_device_count()
    gpu = torch.device("cuda", 0)
    ops = CudaOps(gpu)
    ops.set_device()
    cores = host.host_cores()
    budget = 0.5 if quick else 2.0
    how = versions() + f", CUDA {torch.version.cuda}"
    sources = {
        "device_name": "torch.cuda.get_device_name(0)",
        "gpus_per_node": "torch.cuda.device_count()",
        "gpu_memory_bytes": "torch.cuda.get_device_properties(0).total_memory",
        "usable_memory_bytes": "measured: torch.cuda.mem_get_info free bytes once the CUDA context exists",
        "host_memory_bytes": "MemTotal (cgroup-capped)",
        "host_cores": "logical CPUs this process may use (affinity, cgroup quota)",
    }

    say(progress, f"CUDA context on {ops.name()} ({num_gpus} GPU(s))")
    torch.zeros(1, device=gpu)  # creates the context
    ops.synchronize()
    free_after_context = ops.free_memory_bytes()  # the tensor's cached block is not context
    total = ops.total_memory_bytes()

    tokens, hidden = (4096, 4096) if quick else (8192, 4096)
    matmul: dict[str, float] = {}
    for dtype_name in ("fp32", "tf32", "bf16", "fp16"):
        say(progress, f"matmul {dtype_name}")
        try:
            matmul[dtype_name] = matmul_tflops(gpu, dtype_name, tokens, hidden, budget)
        except RuntimeError:  # e.g. bf16 on a pre-Ampere GPU
            continue
    sources["matmul_tflops"] = (
        f"measured: F.linear on a transformer block's GEMMs (tokens "
        f"{tokens}, hidden {hidden}), CUDA events, median, {how}"
    )

    shapes = CUDA_BLOCKS[:3] if quick else CUDA_BLOCKS
    block_curves, overhead_s, rate_gbps = measure_block_curves(
        gpu, ["bf16", "fp16", "fp32"], shapes, 2 * budget, progress
    )
    model_rates = {dtype: curve[max(curve)] for dtype, curve in block_curves.items()}
    sources.update(block_sources(block_note(shapes, how), " (the first dtype the GPU runs)"))
    # The flat model rate is the largest block's: was its attention fused (no seq x seq scores written)?
    rate_dtype = next(iter(block_curves), "fp32")
    fused_attention = block_attention_fused(gpu, rate_dtype, shapes[-1])
    sources["rate_fused_attention"] = (
        f"measured: the dispatched ops of the largest probe block's scaled_dot_product_attention ({rate_dtype}): "
        + ("a fused kernel" if fused_attention else "the math fallback, which writes the scores")
    )

    say(progress, "HBM copy bandwidth")
    copy_bytes = 256 * MiB if quick else GiB
    hbm = copy_gbps(gpu, copy_bytes, budget)
    sources["hbm_gbps"] = f"measured: copy_ of {copy_bytes // MiB} MiB on GPU 0, (read + write) bytes / s"

    sizes = size_ladder(MiB, 256 * MiB if quick else GiB)
    say(progress, "pinned host<->GPU copies, one GPU")
    h2d_curve, d2h_curve = pinned_copy_curves(0, sizes, 4 * budget)
    latency = pinned_copy_latency_s(0, budget / 4)
    note = f"measured: pinned copy, GPU 0 alone, CUDA events, {asymptotic_note(h2d_curve)}"
    sources.update(
        {"h2d_gbps": note, "d2h_gbps": note, "copy_latency_s": "measured: pinned 4 KiB host->GPU copy, CUDA events"}
    )
    curves = {"h2d_gbps": h2d_curve, "d2h_gbps": d2h_curve}
    if num_gpus > 1:
        say(progress, f"pinned host<->GPU copies, all {num_gpus} GPUs at once")
        h2d_all_curve, d2h_all_curve = pinned_copy_curves_all(num_gpus, sizes, 4 * budget)
        note = (
            f"measured: pinned copy on all {num_gpus} GPUs at once, per-GPU rate from the "
            f"wall time, {asymptotic_note(h2d_all_curve)}"
        )
        curves.update({"h2d_gbps_all": h2d_all_curve, "d2h_gbps_all": d2h_all_curve})
    else:
        h2d_all_curve, d2h_all_curve = h2d_curve, d2h_curve
        note = "one GPU: same as alone"
    sources["h2d_gbps_all"] = sources["d2h_gbps_all"] = note

    say(progress, "GPU Adam")
    adam_elements = 2**24 if quick else 2**26
    gpu_adam, gpu_impl = adam_elems_per_s(gpu, adam_elements, budget)
    sources["gpu_adam_elems_per_s"] = (
        f"measured: torch.optim.AdamW ({gpu_impl}) over {adam_elements} fp32 elements on GPU 0"
    )

    free_now = ops.free_memory_bytes()
    overhead = max(0, free_after_context - free_now)
    sources["allocator_overhead_bytes"] = (
        "measured: device memory the libraries keep after the "
        "benchmarks with no tensor alive (cuBLAS workspaces, "
        "lazily loaded kernels); fragmentation not included"
    )

    threads = max(1, cores // num_gpus)
    cpu_adam_elements = 2**24 if quick else 2**25  # larger than the last-level cache
    if num_gpus > 1:
        say(progress, f"NCCL collectives and CPU Adam in {num_gpus} processes")
        coll_sizes = size_ladder(MiB, 256 * MiB if quick else GiB)
        workers, allgather_gbps, reduce_scatter_gbps, coll_note = run_collectives(
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
        cpu_adam_all, cpu_impl = workers["cpu_adam_elems_per_s"], workers["cpu_adam_impl"]
        say(progress, "CPU Adam, one process alone")
        torch.set_num_threads(threads)
        cpu_adam, _ = adam_elems_per_s(torch.device("cpu"), cpu_adam_elements, budget)
        sources.update(
            {
                "allgather_gbps": coll_note,
                "reduce_scatter_gbps": coll_note,
                "collective_latency_s": "measured: NCCL all-gather of 1 KiB per GPU",
            }
        )
        curves.update({"allgather_gbps": allgather, "reduce_scatter_gbps": reduce_scatter})
    else:
        say(progress, "CPU Adam")
        torch.set_num_threads(threads)
        cpu_adam, cpu_impl = adam_elems_per_s(torch.device("cpu"), cpu_adam_elements, budget)
        cpu_adam_all = cpu_adam
        allgather_gbps = reduce_scatter_gbps = hbm / 2
        coll_latency = 30e-6
        single = "one GPU: no peers, a collective is a local copy (not measured)"
        sources.update(
            {
                "allgather_gbps": single,
                "reduce_scatter_gbps": single,
                "collective_latency_s": "one GPU: default, not measured",
            }
        )

    # One process alone, and every rank's process at once summed: the node (a node's memory bandwidth, not its
    # ranks, bounds it; HardwareSpec.cpu_adam_rate_per_rank takes the smaller of the two).
    node_adam = cpu_adam_all * num_gpus
    sources.update(
        host_adam_sources(cpu_adam, cpu_adam_all, num_gpus, cpu_impl, cpu_adam_elements, f"{threads} thread(s)")
    )
    # No NVLink shows as collectives no faster than a host copy: NCCL then rides the same PCIe links.
    shared_link = num_gpus > 1 and allgather_gbps < 1.5 * asymptotic_gbps(h2d_curve)
    sources["shared_host_link"] = (
        f"derived: all-gather bus bandwidth {allgather_gbps:.1f} GB/s "
        f"{'<' if shared_link else '>='} 1.5 x host->GPU (PCIe) bandwidth"
        if num_gpus > 1
        else "one GPU: no collectives"
    )
    inter_node, sources["inter_node_gbps"] = inter_node_gbps(allgather_gbps)
    return HardwareSpec(
        name=f"probe of {socket.gethostname()} (cuda{', quick' if quick else ''})",
        device="cuda",
        device_name=ops.name(),
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
        pointwise_gbps=rate_gbps,
        cpu_adam_node_elems_per_s=node_adam,
        shared_host_link=shared_link,
        rate_fused_attention=fused_attention,
    )
