"""The CPU as the device: worker processes share the host, gloo carries the collectives."""

from __future__ import annotations

import socket

import torch

from elixir_tune.hardware import host
from elixir_tune.hardware.bench_compute import (
    DROPOUT_ATTENTION_SHAPE,
    adam_elems_per_s,
    copy_gbps,
    dropout_attention_s_per_score,
    matmul_tflops,
)
from elixir_tune.hardware.bench_copy import (
    host_copy_curve,
    host_copy_latency_s,
)
from elixir_tune.hardware.bench_layout import COSTS as LAYOUT_COSTS
from elixir_tune.hardware.bench_layout import LAYOUT_SHAPE, TINY_SHAPE
from elixir_tune.hardware.bench_threads import thread_handoff_s
from elixir_tune.hardware.probe_common import (
    CPU_BLOCKS,
    DROPOUT_ATTENTION_NOTE,
    HANDOFF_NOTE,
    ProbeError,
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

# Rounds of the layout benchmark (hardware/bench_layout.py) at 2 processes. The quick probe's 3 moved
# tensor2_block_extra_ratio 0.09-0.26 from probe to probe (and tensor 2's prediction with it). A round took
# 2.4 s at load 8 on the 2-core VM (the sum of bench_layout's 8 median call times), so about 0.6 s idle
# (an estimate: a quarter of that); 4 more rounds add some 2.5 s to the quick probe.
LAYOUT_REPEATS_QUICK, LAYOUT_REPEATS = 7, 9


def probe_cpu(quick: bool, progress: Progress, procs: int) -> HardwareSpec:
    if procs < 1:
        raise ProbeError(f"procs must be at least 1, got {procs}")
    cpu = torch.device("cpu")
    cores = host.host_cores()
    threads = max(1, cores // procs)
    torch.set_num_threads(threads)
    memory_bytes, available_bytes = host.host_memory_bytes(), host.host_available_bytes()
    budget = 0.8 if quick else 3.0
    tokens, hidden = (512, 512) if quick else (1024, 768)
    how = f"{threads} thread(s) of {cores} core(s), {versions()}"
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
        say(progress, f"matmul {dtype_name} on the CPU ({threads} thread(s))")
        try:
            matmul[dtype_name] = matmul_tflops(cpu, dtype_name, tokens, hidden, budget)
        except RuntimeError:  # fp16 GEMM is missing on some CPU builds
            continue
    sources["matmul_tflops"] = (
        f"measured: F.linear on a transformer block's GEMMs (tokens "
        f"{tokens}, hidden {hidden}), median of repeats, {how}"
    )

    say(progress, "memory copy bandwidth")
    copy_bytes = 64 * MiB if quick else 256 * MiB
    hbm = copy_gbps(cpu, copy_bytes, budget)
    sources["hbm_gbps"] = f"measured: torch copy_ of {copy_bytes // MiB} MiB, (read + write) bytes / s, {how}"

    say(progress, "host copy bandwidth over sizes")
    copy_sizes = size_ladder(MiB, 64 * MiB if quick else GiB)
    h2d_curve = host_copy_curve(copy_sizes, 2 * budget)
    h2d = asymptotic_gbps(h2d_curve)
    latency = host_copy_latency_s(budget / 4)
    sources["h2d_gbps"] = sources["d2h_gbps"] = (
        f"measured: copy between two host buffers (the CPU is the device), one process alone, "
        f"{asymptotic_note(h2d_curve)}, {how}"
    )
    sources["copy_latency_s"] = "measured: median time of one 4 KiB host copy (torch copy_)"
    curves = {"h2d_gbps": h2d_curve, "d2h_gbps": h2d_curve}

    # Larger than the last-level cache, as real shards are.
    adam_elements = 2**24 if quick else 2**25
    block_shapes = CPU_BLOCKS[:3] if quick else CPU_BLOCKS
    if procs > 1:
        say(progress, f"gloo collectives, concurrent copies and CPU Adam in {procs} processes")
        coll_sizes = size_ladder(MiB, 32 * MiB if quick else GiB)
        workers, allgather_gbps, reduce_scatter_gbps, coll_note = run_collectives(
            "cpu",
            procs,
            threads,
            coll_sizes,
            copy_sizes,
            adam_elements,
            budget_s=2 * budget,
            timeout_s=150 if quick else 420,
            block_shapes=block_shapes,
            layout_repeats=(LAYOUT_REPEATS_QUICK if quick else LAYOUT_REPEATS) if procs == 2 else 0,
        )
        allgather, reduce_scatter = workers["allgather"], workers["reduce_scatter"]
        # On the CPU a collective's fixed cost is what it takes between compute (ranks arriving
        # apart, gloo's threads waiting for a core), several times its back-to-back latency.
        coll_latency = max(workers["latency_s"], workers["loaded_latency_s"])
        copy_all = workers["host_copy_all"]
        h2d_all = asymptotic_gbps(copy_all)
        adam, adam_impl = workers["cpu_adam_elems_per_s"], workers["cpu_adam_impl"]
        sources["allgather_gbps"] = coll_note
        sources["reduce_scatter_gbps"] = coll_note + f", op {workers['reduce_scatter_impl']}"
        sources["collective_latency_s"] = (
            "measured: a gloo all-gather of 1 KiB per process right after a block forward+backward, less the "
            "block alone, all processes at once, the median of paired runs' differences, the largest process's "
            f"(back to back it takes {workers['latency_s'] * 1e6:.0f} us)"
        )
        sources["h2d_gbps_all"] = sources["d2h_gbps_all"] = (
            f"measured: host copy in all {procs} processes at once, mean per process, {asymptotic_note(copy_all)}"
        )
        sources["gpu_adam_elems_per_s"] = (
            f"measured: torch.optim.AdamW ({adam_impl}) over {adam_elements} fp32 elements, all "
            f"{procs} processes stepping at once, {how}"
        )
        say(progress, "CPU Adam, one process alone")
        adam_alone, _ = adam_elems_per_s(cpu, adam_elements, budget)
        curves.update(
            {
                "h2d_gbps_all": copy_all,
                "d2h_gbps_all": copy_all,
                "allgather_gbps": allgather,
                "reduce_scatter_gbps": reduce_scatter,
            }
        )
        layout = workers.get("layout", {})
        if layout:
            layout_note = (
                f"measured: hardware/bench_layout.py at degree 2, a GPT-2 block {LAYOUT_SHAPE} (batch, seq, hidden, "
                f"heads) and a tiny one {TINY_SHAPE} for the fixed costs, median over "
                f"{LAYOUT_REPEATS_QUICK if quick else LAYOUT_REPEATS} rounds, both processes at once, {how}"
            )
            for name in LAYOUT_COSTS:
                spread = (
                    f"; quartiles over the rounds {layout[name + '_q1']:.3g}-{layout[name + '_q3']:.3g}"
                    if name + "_q1" in layout
                    else ""
                )
                sources[name] = layout_note + spread
    else:
        layout = {}
        say(progress, "CPU Adam")
        adam, adam_impl = adam_elems_per_s(cpu, adam_elements, budget)
        adam_alone = adam
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
                "gpu_adam_elems_per_s": f"measured: torch.optim.AdamW ({adam_impl}), {how}",
            }
        )

    # fp32 only: a CPU's fp16 (and often bf16) blocks run at a few GFLOP/s and would take minutes;
    # the other dtypes' curves are fp32's scaled by their matmul rate. With several processes the
    # workers measured it all at once (they share caches and memory bandwidth, as in training).
    if procs > 1:
        block_curves, overhead_s = {"fp32": workers["block_curve"]}, workers["block_overhead_s"]
        rate_gbps = workers["pointwise_gbps"]
        block_how = f"all {procs} processes at once, {how}"
    else:
        block_curves, overhead_s, rate_gbps = measure_block_curves(cpu, ["fp32"], block_shapes, 6 * budget, progress)
        block_how = how
    say(progress, "thread hand-overs")
    handoff_s = thread_handoff_s(budget)
    say(progress, "attention with dropout (the CPU's math path)")
    dropout_score_s = dropout_attention_s_per_score(budget)
    sources["dropout_attention_s_per_score"] = DROPOUT_ATTENTION_NOTE.format(
        shape=DROPOUT_ATTENTION_SHAPE, threads=threads
    )
    for dtype_name, tflops in matmul.items():
        if dtype_name != "fp32":
            ratio = tflops / matmul["fp32"]
            block_curves[dtype_name] = {numel: rate * ratio for numel, rate in block_curves["fp32"].items()}
    model_rates = {dtype: curve[max(curve)] for dtype, curve in block_curves.items()}
    curve_note = block_note(block_shapes, block_how) + "; fp32 measured, other dtypes x their matmul rate / fp32's"
    sources.update(block_sources(curve_note, f", {block_how}"))
    sources["thread_handoff_s"] = HANDOFF_NOTE
    # The device Adam (gpu_adam_elems_per_s) is every process's at once, as a CPU device's ranks step; host
    # Adam is one process alone and the node's sum at once (HardwareSpec.cpu_adam_rate_per_rank takes the smaller).
    node_adam = adam * procs
    sources.update(host_adam_sources(adam_alone, adam, procs, adam_impl, adam_elements, how))
    shared_link = False
    sources["shared_host_link"] = "the CPU is the device: no host link"
    inter_node, sources["inter_node_gbps"] = inter_node_gbps(allgather_gbps)
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
        cpu_adam_elems_per_s=adam_alone,
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
        pointwise_gbps=rate_gbps,
        thread_handoff_s=handoff_s,
        dropout_attention_s_per_score=dropout_score_s,
        cpu_adam_node_elems_per_s=node_adam,
        shared_host_link=shared_link,
        tensor2_block_extra_ratio=max(0.0, layout.get("tensor2_block_extra_ratio", 0.0)),
        pipeline_microbatch_extra_ratio=max(0.0, layout.get("pipeline_microbatch_extra_ratio", 0.0)),
        tensor2_block_fixed_s=max(0.0, layout.get("tensor2_block_fixed_s", 0.0)),
        pipeline_stage_microbatch_s=max(0.0, layout.get("pipeline_stage_microbatch_s", 0.0)),
    )
