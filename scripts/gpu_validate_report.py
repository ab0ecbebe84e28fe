"""The markdown report of scripts/gpu_validate.py, from its JSON record (any part of it: a run cut
off early still has a readable report)."""

from __future__ import annotations

import re

GiB = 2**30


def _gib(value) -> str:
    return f"{value / GiB:.2f}" if isinstance(value, (int, float)) and value else "-"


def _num(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def _shape(row: dict) -> str:
    s = row.get("shape")
    if not s:
        return "-"
    return (
        f"chunk {s['chunk_size']:,} el., cache {s['cache_blocks']}/{s['cacheable_chunks']}, "
        f"pf {s['prefetch']}, offload {s['offloaded_chunks']}/{s['num_chunks']}, ckpt {s['checkpointing']}, "
        f"mb {s['micro_batch_size']}x{s['grad_accum_steps']}"
    )


def loaded(record: dict) -> bool:
    """Whether the probe of this run measured a loaded machine (its rates, and so the predictions, read slow)."""
    return bool(record.get("probe_load", {}).get("loaded"))


def load_line(record: dict) -> str:
    """The probe's load in a few words: busy cores before and after, and the hypervisor's steal."""
    load = record.get("probe_load", {})
    return (
        f"{load.get('busy_cores_before', 0):.1f} and {load.get('busy_cores_after', 0):.1f} of "
        f"{load.get('cores', 0):.0f} cores busy before and after it, steal {load.get('steal_share', 0):.0%}"
    )


def write_markdown(record: dict) -> str:
    """The whole report as markdown."""
    machine = record.get("machine", {})
    title = "GPU validation (CPU dry run)" if record.get("dry_run_cpu") else "GPU validation"
    lines = [f"# {title}: {machine.get('device_name', '?')}", ""]
    lines.append(
        f"- machine: {machine.get('device_name')} x {machine.get('gpus')}, driver {machine.get('driver', '-')}, "
        f"torch {machine.get('torch')} (CUDA {machine.get('cuda')}), Python {machine.get('python')}, "
        f"{machine.get('cpu_cores')} CPU cores, load {machine.get('load_avg_1min')}, {machine.get('date_utc')} UTC, "
        f"commit {machine.get('commit', '?')}"
    )
    lines.append(
        f"- command: `python scripts/gpu_validate.py {' '.join(record.get('argv', []))}` ({record.get('elapsed_s')} s)"
    )
    if loaded(record):
        lines.append(
            f"- **measured under load**: the probe found other work on the machine ({load_line(record)}); "
            "every predicted figure below comes from those rates and every measured one shared the machine"
        )
    model = record.get("model")
    if model:
        lines.append(
            f"- model: GPT-2 n_embd {model['hidden']}, {model['layers']} layers, {model['heads']} heads, vocab "
            f"{model['vocab']}, seq {model['seq']}: {model['num_params']:,} parameters, model states "
            f"{model['model_state_bytes'] / GiB:.3g} GiB = {model['model_state_bytes'] / model['device_memory_bytes']:.3g}x "
            f"device memory ({model['why']}); {model['dtype']}, {model['per_rank_batch']} samples per GPU per step"
        )
        lines.append(
            f"- TFLOPS/GPU = profiled model FLOPs per sample (forward+backward, recomputation not counted) x "
            f"samples per GPU / measured step time; MFU against {model['peak_tflops']:.3g} TFLOP/s"
        )
    lines += ["", "## Plans: predicted vs measured", ""]
    lines.append(
        "| world | shape | plan | predicted s | measured s | measured / predicted | predicted GPU GiB | "
        "max allocated GiB | max reserved GiB | predicted host GiB | peak RSS GiB (max rank) | TFLOPS/GPU | MFU | status |"
    )
    lines.append("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in record.get("rows", []):
        lines.append(
            f"| {row['world']} | {row['name']} | {_shape(row)} | {_num(row.get('predicted_step_time_s'), '.3f')} | "
            f"{_num(row.get('measured_step_time_s'), '.3f')} | {_num(row.get('time_ratio'), '.2f')} | "
            f"{_gib(row.get('predicted_peak_gpu_bytes'))} | {_gib(row.get('max_memory_allocated_bytes'))} | "
            f"{_gib(row.get('max_memory_reserved_bytes'))} | {_gib(row.get('predicted_peak_host_bytes'))} | "
            f"{_gib(row.get('peak_rss_bytes'))} | {_num(row.get('tflops_per_gpu'), '.3g')} | "
            f"{_num(row.get('mfu'), '.1%')} | {row.get('status', '')} |"
        )
    lines += ["", "## Peers: the same model, batch, sequence and checkpointing", ""]
    lines.append(
        "| system | step s | vs our best (measured) | max allocated GiB | max reserved GiB | peak RSS GiB | TFLOPS/GPU | MFU | status |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for peer in record.get("peers", []):
        lines.append(
            f"| {peer['name']} | {_num(peer.get('median_step_time_s'), '.3f')} | {_num(peer.get('vs_our_best'), '.2f')} | "
            f"{_gib(peer.get('max_memory_allocated_bytes'))} | {_gib(peer.get('max_memory_reserved_bytes'))} | "
            f"{_gib(peer.get('peak_rss_bytes'))} | {_num(peer.get('tflops_per_gpu'), '.3g')} | "
            f"{_num(peer.get('mfu'), '.1%')} | {peer.get('status', '')} {peer.get('note', '')} |"
        )
    lines += ["", "## Engines: the search's best plan on FSDP2 and DeepSpeed (elixir-run, same script)", ""]
    lines.append("| world | plan | engine settings | step s | vs elixir | max allocated GiB | peak RSS GiB | status |")
    lines.append("|---:|---|---|---:|---:|---:|---:|---|")
    for row in record.get("engines", []):
        lines.append(
            f"| {row['world']} | {row['name']} | {row.get('engine_settings', '')} | "
            f"{_num(row.get('measured_step_time_s'), '.3f')} | {_num(row.get('vs_elixir'), '.2f')} | "
            f"{_gib(row.get('max_memory_allocated_bytes'))} | {_gib(row.get('peak_rss_bytes'))} | {row.get('status', '')} |"
        )
    if record.get("world2"):
        lines += ["", f"World 2: {record['world2']}."]
    lines += ["", "## Steps (every command, in order)", ""]
    lines.append("| step | exit | s | command |")
    lines.append("|---|---|---:|---|")
    for step in record.get("steps", []):
        command = step.get("command") or step.get("reason", "")
        lines.append(f"| {step['name']} | {step['rc']} | {step.get('elapsed_s', '-')} | `{command}` |")
    failed = [s for s in record.get("steps", []) if s.get("rc") not in (0, "skipped")]
    for step in failed:
        lines += [
            "",
            f"### {step['name']}: exit {step['rc']}, output tail",
            "",
            "```",
            step.get("output_tail", "")[-1500:],
            "```",
        ]
    return "\n".join(lines) + "\n"


def error_line(step: dict) -> str:
    """The last line of a step's output that names an error (else its last line)."""
    lines = [line.strip() for line in step.get("output_tail", "").splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"(Error|error:|Exception|OOM|out of memory)", line)]
    return ((errors or lines or ["(no output)"])[-1])[:400]


def summary(record: dict) -> str:
    lines = [f"gpu_validate: {record['machine']['device_name']}, {record.get('elapsed_s')} s"]
    if loaded(record):
        lines.append(f"  MEASURED UNDER LOAD: the probe saw {load_line(record)}")
    for row in record["rows"]:
        if "measured_step_time_s" in row and "time_ratio" in row:
            lines.append(
                f"  w{row['world']} {row['name']:<16} predicted {row['predicted_step_time_s']:.3f} s, measured "
                f"{row['measured_step_time_s']:.3f} s ({row['time_ratio']:.2f}x), {row['status']}"
            )
        else:
            lines.append(f"  w{row['world']} {row['name']:<16} {row['status']}")
    for row in record.get("engines", []):
        measured = f"{row['measured_step_time_s']:.3f} s" if "measured_step_time_s" in row else ""
        lines.append(f"  engine {row['name']:<24} {measured} {row.get('status', '')[:120]}")
    for peer in record["peers"]:
        measured = f"{peer['median_step_time_s']:.3f} s" if "median_step_time_s" in peer else ""
        lines.append(f"  peer {peer['name']:<12} {measured} {peer['status'][:120]}")
    return "\n".join(lines)
