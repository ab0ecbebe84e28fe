"""`elixir-tune probe`: measure this machine (GPUs, or the CPU as the device); write hardware.yaml."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import click

from elixir_tune.cli.console import (
    EXIT_FAILED,
    Progress,
    SpinnerColumn,
    Table,
    TextColumn,
    TimeElapsedColumn,
    console,
    err_console,
    fail,
    print_json,
)
from elixir_tune.hardware import HardwareSpec, closest_preset, load_hardware, save_hardware
from elixir_tune.hardware.load import judge, load_record, loaded_note, sample_load, sample_reasons
from elixir_tune.units import gib

# Seconds to wait before checking a loaded machine again (the quick probe itself takes ~35 s idle).
LOAD_WAIT_S = 15.0
ALLOW_LOADED_HINT = (
    "stop the other work (see `top`) and run the probe again, or pass --allow-loaded to write the file "
    "anyway, marked as measured under load (`search` then warns)"
)


class LoadedMachine(Exception):
    """The machine stayed loaded through every retry; the message says what was seen."""


def measure_when_idle(
    measure: Callable[[], HardwareSpec],
    retries: int,
    allow_loaded: bool,
    say: Callable[[str], None],
    wait_s: float = LOAD_WAIT_S,
) -> tuple[HardwareSpec, list[str]]:
    """Runs ``measure`` on a machine not loaded by other work (``hardware/load.py``).

    The machine is sampled before and after each measurement. Loaded before: wait ``wait_s`` and
    sample again; loaded during: measure again. Both use up ``retries``.

    Args:
        measure: the probe.
        retries: waits and repeated measurements allowed in all.
        allow_loaded: when still loaded, keep the last measurement instead of refusing.
        say: prints one line of progress.
        wait_s: seconds between samples of a loaded machine.

    Returns:
        The spec, with ``probe_load`` recording the load, and the reasons it was judged loaded (empty: idle).

    Raises:
        LoadedMachine: still loaded after ``retries`` and not ``allow_loaded``.
    """
    retries_left = retries
    while True:
        before = sample_load()
        reasons = sample_reasons(before, "before the probe")
        if reasons and retries_left:
            say(f"the machine is loaded: {reasons[0]}; waiting {wait_s:.0f} s ({retries_left} retries left)")
            retries_left -= 1
            time.sleep(wait_s)
            continue
        if reasons and not allow_loaded:
            raise LoadedMachine("; ".join(reasons))
        spec = measure()
        after = sample_load()
        reasons = judge(before, after)
        if not reasons or not retries_left:
            break
        say(f"the machine was loaded during the probe: {reasons[0]}; measuring again ({retries_left} retries left)")
        retries_left -= 1
    if reasons and not allow_loaded:
        raise LoadedMachine("; ".join(reasons))
    record = load_record(before, after)
    sources = dict(
        spec.sources,
        probe_load="hardware/load.py: /proc/stat and /proc/loadavg sampled before and after "
        "the probe while it ran nothing, a reference loop's repeats; loaded 1: " + ("; ".join(reasons) or "-"),
    )
    return dataclasses.replace(spec, probe_load=record, sources=sources), reasons


def _rate(value: float, unit: str) -> str:
    return f"{value:.3g} {unit}"


def _rows(spec: HardwareSpec) -> list[tuple[str, str]]:
    """(label, value) pairs for the table, in reading order."""
    rows = [
        ("device", f"{spec.device}: {spec.device_name}"),
        ("devices per node", str(spec.gpus_per_node)),
        ("memory total / usable", f"{gib(spec.gpu_memory_bytes)} / {gib(spec.usable_memory_bytes)}"),
        ("allocator overhead", gib(spec.allocator_overhead_bytes)),
    ]
    rows += [(f"matmul {dtype}", _rate(tflops, "TFLOP/s")) for dtype, tflops in spec.matmul_tflops.items()]
    rows += [(f"model rate {dtype}", _rate(tflops, "TFLOP/s")) for dtype, tflops in spec.model_tflops.items()]
    if spec.block_call_overhead_s:
        rows.append(("block call overhead", f"{spec.block_call_overhead_s * 1e3:.3g} ms"))
    if spec.pointwise_gbps:
        rows.append(("pointwise ops", _rate(spec.pointwise_gbps, "GB/s written")))
    if spec.thread_handoff_s:
        rows.append(("thread hand-over", f"{spec.thread_handoff_s * 1e6:.3g} us"))
    if spec.dropout_attention_s_per_score:
        rows.append(("attention with dropout", f"{spec.dropout_attention_s_per_score * 1e9:.3g} ns per score element"))
    rows += [
        ("memory copy", _rate(spec.hbm_gbps, "GB/s")),
        ("h2d / d2h alone", f"{spec.h2d_gbps:.3g} / {spec.d2h_gbps:.3g} GB/s"),
        ("h2d / d2h all at once", f"{spec.h2d_gbps_all:.3g} / {spec.d2h_gbps_all:.3g} GB/s per device"),
        ("copy latency", f"{spec.copy_latency_s * 1e6:.3g} us"),
        ("all-gather busbw", _rate(spec.allgather_gbps, "GB/s")),
        ("reduce-scatter busbw", _rate(spec.reduce_scatter_gbps, "GB/s")),
        ("collective latency", f"{spec.collective_latency_s * 1e6:.3g} us"),
        ("inter-node busbw", _rate(spec.inter_node_gbps, "GB/s")),
        ("device Adam", _rate(spec.gpu_adam_elems_per_s, "elem/s")),
        ("CPU Adam, one process alone", _rate(spec.cpu_adam_elems_per_s, "elem/s")),
        (
            "CPU Adam, node (all at once)",
            _rate(spec.cpu_adam_node_elems_per_s or spec.cpu_adam_elems_per_s * spec.gpus_per_node, "elem/s"),
        ),
        ("collectives share PCIe", "yes" if spec.shared_host_link else "no"),
        ("host RAM / cores", f"{gib(spec.host_memory_bytes)} / {spec.host_cores}"),
    ]
    if spec.probe_load:
        load = spec.probe_load
        rows.append(
            (
                "measured under load",
                f"{'LOADED' if load.get('loaded') else 'idle'}: {load.get('busy_cores_before', 0):.1f} / "
                f"{load.get('busy_cores_after', 0):.1f} cores busy elsewhere, steal {load.get('steal_share', 0):.0%}",
            )
        )
    return rows


def _table(spec: HardwareSpec, preset_id: str | None) -> Table:
    preset = load_hardware(preset_id) if preset_id else None
    table = Table(title=f"measured: {spec.name}")
    table.add_column("quantity")
    table.add_column("measured", justify="right")
    if preset is not None:
        table.add_column(f"closest preset: {preset_id}", justify="right", style="dim")
        preset_rows = dict(_rows(preset))
    for label, value in _rows(spec):
        cells = [label, value] + ([preset_rows.get(label, "-")] if preset is not None else [])
        table.add_row(*cells)
    return table


@click.command("probe")
@click.option(
    "--quick",
    is_flag=True,
    help="Fewer sizes and repeats (~35 s on an idle 2-core machine, the engine's layout costs included).",
)
@click.option(
    "--out",
    "out_path",
    default="hardware.yaml",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Where to write the spec.",
)
@click.option(
    "--procs",
    type=click.IntRange(min=1),
    default=None,
    help="CPU-only machine: worker processes the CPU is split into (default 2). Ignored when there are GPUs.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the spec as JSON (progress on stderr).")
@click.option(
    "--allow-loaded",
    is_flag=True,
    help="Write the file even when other work loads the machine (marked so; `search` warns). Default: refuse.",
)
@click.option(
    "--load-retries",
    type=click.IntRange(min=0, max=10),
    default=2,
    show_default=True,
    help="On a loaded machine: waits (before measuring) or repeated probes (loaded during it) before giving up.",
)
def probe_command(
    quick: bool, out_path: str, procs: int | None, as_json: bool, allow_loaded: bool, load_retries: int
) -> None:
    """Measure this machine (GPUs, or the CPU as the device) and write hardware.yaml.

    Measures memory, matmul rate per dtype, memory copy bandwidth, host<->device
    bandwidth over sizes (one device and all at once), all-gather and reduce-scatter
    bus bandwidth across the local devices (NCCL; gloo between CPU processes), GPU
    and CPU Adam rates, host RAM and cores. Every number's method is recorded in the
    file's `sources`. The result can replace a preset anywhere one is accepted.

    \b
    Examples:
        elixir-tune probe --quick --out hardware.yaml
        elixir-tune probe --procs 4            # CPU-only machine as 4 workers
        elixir-tune search --gpus 2 --hardware hardware.yaml
    """
    from elixir_tune.device import cuda_available  # imports torch: after click parsed, --help stays fast

    if procs is not None and cuda_available():
        err_console.print("[yellow]note:[/] --procs applies to CPU-only machines; measuring the GPUs instead.")
    begin = time.perf_counter()
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]probe[/] {task.description}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as progress:
        task = progress.add_task("starting", total=None)
        done: list[str] = []

        def report(message: str) -> None:
            if done:
                progress.console.print(f"[green]done[/] {done[-1]}", highlight=False)
            done.append(message)
            progress.update(task, description=message)

        try:
            # Imported here: it loads torch, which `elixir-tune --help` must not wait for.
            from elixir_tune.cli.probe_engine import probe_with_engine

            spec, loaded = measure_when_idle(
                lambda: probe_with_engine(quick=quick, progress=report, procs=procs),
                load_retries,
                allow_loaded,
                lambda line: progress.console.print(f"[yellow]note:[/] {line}", highlight=False),
            )
        except LoadedMachine as error:
            fail(f"the machine is loaded by other work: {error}", hint=ALLOW_LOADED_HINT, code=EXIT_FAILED)
        except (RuntimeError, OSError, ValueError) as error:
            fail(
                f"the probe failed: {error}",
                hint="run again with --quick to narrow it down; on a GPU machine check that "
                "torch sees the GPUs (python -c 'import torch; print(torch.cuda.device_count())')",
                code=EXIT_FAILED,
            )
        if done:
            progress.console.print(f"[green]done[/] {done[-1]}", highlight=False)
    elapsed_s = time.perf_counter() - begin
    if loaded:
        err_console.print(
            f"[yellow]warning:[/] the probe ran on a loaded machine ({'; '.join(loaded)}); "
            "written anyway (--allow-loaded), its rates may read slow",
            soft_wrap=True,
        )

    header = (
        f"Measured by `elixir-tune probe{' --quick' if quick else ''}` in {elapsed_s:.1f} s.\n"
        f"Use it: elixir-tune search --gpus {spec.gpus_per_node} --hardware {out_path}\n"
        f"How each number was measured: see `sources`; curves over sizes: `bandwidth_curves`."
        + (f"\nWarning: {loaded_note(spec.probe_load)}." if loaded else "")
    )
    try:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        save_hardware(spec, out_path, header=header)
    except OSError as error:
        fail(f"cannot write {out_path}: {error}", hint="pass a writable path with --out")
    preset_id = closest_preset(spec)

    if as_json:
        print_json(
            {
                "path": out_path,
                "elapsed_s": round(elapsed_s, 2),
                "closest_preset": preset_id,
                "hardware": spec.to_dict(),
            }
        )
        return
    console.print(_table(spec, preset_id))
    console.print(
        f"[green]wrote {out_path}[/] in {elapsed_s:.1f} s; use it with "
        f"[bold]elixir-tune search --gpus {spec.gpus_per_node} --hardware {out_path}[/]",
        soft_wrap=True,
    )
