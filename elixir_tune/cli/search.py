"""`elixir-tune search --gpus N`: the fastest plan that fits, and a table of the best candidates."""

from __future__ import annotations

import functools
import os
import re
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import click

from elixir_tune.cli import time_to_train
from elixir_tune.cli.bench import measure_options, measure_search
from elixir_tune.cli.candidates import candidates_table
from elixir_tune.cli.console import console, err_console, fail, print_json, print_wide, refuse_output_over_input
from elixir_tune.cli.default_outputs import guards_default_output, refuse_replacing_plan
from elixir_tune.cli.run_script import run_script_for
from elixir_tune.cli.time_to_train import time_to_train_options
from elixir_tune.hardware.networks import with_network
from elixir_tune.plan import save_plan, validate
from elixir_tune.units import gib

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """Bytes from '549755813888', '512GiB', '0.5TB' or '1e12'.

    Raises:
        click.BadParameter: not a size.
    """
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise click.BadParameter(f"{text!r}: expected bytes, e.g. 549755813888 or 512GiB")
    try:
        return int(float(match.group(1)) * _UNITS[unit])
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected bytes, e.g. 549755813888 or 512GiB") from None


def _bytes_option(text: str | None, option: str) -> int | None:
    """A memory size option (None when not given).

    Raises:
        click.BadParameter: not a size, or not positive (names the option).
    """
    if text is None:
        return None
    try:
        value = parse_bytes(text)
    except click.BadParameter as error:
        raise click.BadParameter(error.message, param_hint=option) from None
    if value <= 0:
        raise click.BadParameter(f"{text!r}: expected a positive size, e.g. 40GiB", param_hint=option)
    return value


def _load_inputs(profile_path: str, hardware_ref: str | None):
    from elixir_tune.hardware import load_hardware
    from elixir_tune.profiler.schema import load_profile

    try:
        profile = load_profile(profile_path)
    except (FileNotFoundError, ValueError) as error:
        fail(str(error), hint="write one with `elixir-tune profile MODEL --out profile.yaml` or pass --profile FILE")
    if hardware_ref is None:
        if not Path("hardware.yaml").is_file():
            fail(
                "no hardware given and no hardware.yaml here",
                hint="run `elixir-tune probe` to measure this machine, or pass a preset, e.g. "
                "--hardware a100-40gb-pcie",
            )
        hardware_ref = "hardware.yaml"
    try:
        hardware = load_hardware(hardware_ref)
    except (FileNotFoundError, ValueError) as error:
        fail(str(error), hint="pass a preset id (see configs/hardware/) or a file written by `elixir-tune probe`")
    warn_loaded_hardware(hardware, hardware_ref)
    return profile, hardware, hardware_ref


def warn_loaded_hardware(hardware, hardware_ref: str) -> None:
    """One warning line when the hardware file was probed on a loaded machine (``hardware/load.py``)."""
    from elixir_tune.hardware.load import loaded_note

    note = loaded_note(hardware.probe_load)
    if note:
        err_console.print(
            f"[yellow]warning:[/] {hardware_ref}: {note}; plans made with it may be wrong. Probe again on an idle "
            "machine (`elixir-tune probe`)",
            soft_wrap=True,
        )


@click.command("search")
@click.option(
    "--gpus", type=click.IntRange(min=1), default=None, help="GPUs (ranks) per node (required without --max-gpus)."
)
@click.option("--nodes", type=click.IntRange(min=1), default=None, help="Nodes [default: 1].")
@click.option(
    "--profile",
    "profile_path",
    default="profile.yaml",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Model profile from `elixir-tune profile`.",
)
@click.option(
    "--hardware",
    "hardware_ref",
    default=None,
    help="Preset id (e.g. a100-40gb-pcie) or a file from `elixir-tune probe` [default: hardware.yaml].",
)
@click.option(
    "--global-batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="Samples per optimizer step over all GPUs [default: 8 per GPU].",
)
@click.option(
    "--host-memory",
    "host_memory",
    default=None,
    help="Host memory per node to plan with, bytes or with a unit (512GiB) [default: the hardware's].",
)
@click.option(
    "--device-memory",
    "device_memory",
    default=None,
    help="Cap on the device memory a rank may fill, bytes or with a unit (40GiB) [default: the hardware's usable].",
)
@click.option(
    "--fix",
    "fixes",
    multiple=True,
    metavar="KEY=VALUE",
    help="Pin a choice (repeatable): chunk_size=<elements>, cache_blocks=<n>|all, offload=<0..1>, "
    "prefetch=<n>, micro_batch_size=<n>, checkpointing=none|all|every:<k>, dtype=fp32|bf16|fp16, accumulation=standard|layered, "
    "pipeline=<stages>, assignment=modular|contiguous, schedule=looped_bfs|1f1b, tensor=<degree>, tensor_mode=1d|2d, expert=<degree>, context=<degree>, context_mode=ulysses|allgather|ring, engine=elixir|fsdp2|deepspeed.",
)
@click.option(
    "--loop",
    type=click.Choice(["plain", "forward_backward"]),
    default="plain",
    show_default=True,
    help="What the training script runs each step. plain: model(**batch) and optimizer.backward(loss) per "
    "micro-batch (data parallelism, standard accumulation); forward_backward: "
    "loss = model.forward_backward(micro_batches) on the data slice of elixir_tune.data_rank(), which also "
    "allows pipeline, tensor and layered plans (the shipped scripts run it).",
)
@click.option(
    "--top",
    "top_k",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="How many of the best candidates to show.",
)
@click.option(
    "--strategy",
    type=click.Choice(["joint", "elixir"]),
    default="joint",
    show_default=True,
    help="joint: our search; elixir: Elixir's rule, scored by our cost model (a baseline).",
)
@click.option(
    "--out",
    "out_path",
    default="plan.yaml",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Where to write the plan.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace plan.yaml (when --out is not given) even if it holds another plan: another model, cluster, "
    "batch or settings.",
)
@click.option(
    "--timeline",
    "timeline_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Also draw the predicted step of the best plan and the runner-up to this SVG file.",
)
@click.option(
    "--engine",
    type=click.Choice(["elixir", "fsdp2", "deepspeed", "any"]),
    default="elixir",
    show_default=True,
    help="Who runs the plan: our engine, PyTorch FSDP2 or DeepSpeed ZeRO (data parallelism), or any (ranked together).",
)
@measure_options
@time_to_train_options
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def search_command(
    gpus: int | None,
    nodes: int | None,
    profile_path: str,
    hardware_ref: str | None,
    global_batch_size: int | None,
    host_memory: str | None,
    device_memory: str | None,
    fixes: tuple[str, ...],
    loop: str,
    top_k: int,
    strategy: str,
    out_path: str,
    force: bool,
    timeline_path: str | None,
    train_tokens: str | None,
    max_gpus: int | None,
    objective: str,
    gpu_hour_price: float | None,
    batch_limit: str | None,
    full_frontier: bool,
    network: str | None,
    engine: str,
    as_json: bool,
    **measure: object,
) -> None:
    """Search chunking, caching, offload, checkpointing, batching and pipeline/tensor parallelism; write plan.yaml.

    The plan is a contract with the training script: by default (--loop plain) only plans
    that a plain DDP-style loop runs; --loop forward_backward when the script runs
    model.forward_backward(micro_batches) on the slice of elixir_tune.data_rank().

    Every candidate is scored by the step time a timeline simulation predicts
    (compute, collectives, host<->GPU copies, CPU Adam) with the hardware's
    measured rates; candidates that do not fit in GPU or host memory are never
    returned. Exits 1 with what the smallest configuration needs when nothing fits.

    \b
    Example:
        elixir-tune search --gpus 4 --profile profile.yaml --hardware a100-40gb-pcie
        elixir-tune search --gpus 2 --hardware cpu --fix offload=0.5 --fix cache_blocks=all
        elixir-tune search --gpus 4 --hardware a100-40gb-pcie --timeline step.svg
        elixir-tune search --gpus 8 --nodes 2 --hardware h100-80gb-sxm --loop forward_backward --fix tensor=2
        elixir-tune search --train-tokens 3.5T --max-gpus 4096 --hardware h100-80gb-sxm --loop forward_backward

    With --train-tokens: the time, GPU-hours and cluster to train on that many tokens, over cluster
    sizes up to --max-gpus (or the --gpus/--nodes cluster) and global batches up to a batch limit
    (Kaplan et al. 2020's critical batch: an estimate; --batch-limit overrides); writes the chosen
    cluster's plan. --network eth-25 prices a slower inter-node link.
    """
    from elixir_tune.search import InfeasibleError, search

    refuse_output_over_input(out_path, {"--profile": profile_path, "--hardware": hardware_ref})
    write = functools.partial(write_plan, keep=guards_default_output("out_path", force))
    host_bytes = _bytes_option(host_memory, "--host-memory")
    device_bytes = _bytes_option(device_memory, "--device-memory")
    profile, hardware, hardware_ref = _load_inputs(profile_path, hardware_ref)
    hardware = with_network(hardware, network)
    if train_tokens is not None:
        search_kwargs = dict(host_memory_bytes=host_bytes, fixed=list(fixes), top_k=top_k, strategy=strategy)
        search_kwargs.update(hardware_id=hardware_ref, loop=loop, device_memory_bytes=device_bytes)
        time_to_train.run(
            profile=profile,
            profile_path=profile_path,
            hardware=hardware,
            hardware_ref=hardware_ref,
            train_tokens_text=train_tokens,
            max_gpus=max_gpus,
            gpus=gpus,
            nodes=nodes,
            objective=objective,
            gpu_hour_price=gpu_hour_price,
            batch_limit_text=batch_limit,
            full_frontier=full_frontier,
            global_batch_size=global_batch_size,
            search_kwargs=search_kwargs,
            out_path=out_path,
            as_json=as_json,
            write_plan=write,
        )
        return
    if gpus is None:
        fail(
            "missing option --gpus",
            hint="give --gpus N (GPUs per node), or --train-tokens D --max-gpus G to plan a whole run",
        )
    nodes = nodes or 1
    warn_cpu_oversubscription(hardware.device, gpus)
    try:
        with err_console.status(f"searching plans for {profile.name} on {nodes} x {gpus} x {hardware.name} ..."):
            result = search(
                profile,
                hardware,
                gpus_per_node=gpus,
                nodes=nodes,
                global_batch_size=global_batch_size,
                host_memory_bytes=host_bytes,
                fixed=list(fixes),
                top_k=top_k,
                strategy=strategy,
                hardware_id=hardware_ref,
                loop=loop,
                device_memory_bytes=device_bytes,
                profile_path=str(Path(profile_path).resolve()),
                engine=engine,
            )
    except InfeasibleError as error:
        message, _, hint = str(error).partition("; try: ")
        fail(message, hint="try " + hint if hint else "")
    except ValueError as error:
        fail(str(error), hint="see `elixir-tune search --help` for the accepted values")
    plan = result.plan
    prediction = plan.prediction
    assert prediction is not None, "search always writes a prediction"
    run_script, run_note = write(result, profile, profile_path, hardware_ref, out_path, f"--gpus {gpus}")
    if timeline_path:
        _draw(timeline_path, result, result.usable_gpu_bytes)
    if measure["measure"]:
        print_wide(candidates_table([c.row() for c in result.candidates], "predicted"))
        host = host_bytes if host_bytes is not None else hardware.host_memory_bytes
        return measure_search(result, profile, hardware, hardware_ref, out_path, host, measure)
    rows = [c.row() for c in result.candidates]
    if as_json:
        print_json(
            {
                "plan": out_path,
                "strategy": strategy,
                "elapsed_s": round(result.elapsed_s, 3),
                "candidates_scored": result.num_scored,
                "why": result.why,
                "prediction": vars(prediction),
                "candidates": rows,
            }
        )
        return
    title = (
        f"{profile.name} on {nodes} x {gpus} x {hardware.name}, global batch {plan.training.global_batch_size}: "
        f"best {len(rows)} of {result.num_scored} scored in {result.elapsed_s:.2f} s"
    )
    print_wide(candidates_table(rows, title))
    console.print(f"[bold]why #1:[/] {result.why}", soft_wrap=True)
    console.print(
        f"wrote [bold]{out_path}[/]; explain it with `elixir-tune show {out_path}`, run it with "
        f"`elixir-run {out_path} {run_script}`" + (f" ({run_note})" if run_note else ""),
        soft_wrap=True,
    )


def write_plan(
    result, profile, profile_path: str, hardware_ref: str, out_path: str, args: str, keep: bool = False
) -> tuple[str, str]:
    """Validates the search's plan and writes it with a header that says how it was made and run.

    Args:
        result: the ``SearchResult`` whose plan is written.
        profile: the model profile.
        profile_path: its file (named in the header).
        hardware_ref: the hardware preset or file (named in the header).
        out_path: where to write.
        args: the search's arguments, when this process was not started as ``elixir-tune search``.
        keep: ``out_path`` is the default output: exit instead of replacing another plan there
            (``default_outputs.py``).

    Returns:
        (the script ``elixir-run`` runs, why when it is not a recipe's plain command).
    """
    plan = result.plan
    problems = validate(plan)
    if problems:  # a bug, not a user error: say so plainly
        fail("the search produced an invalid plan: " + "; ".join(problems))
    if keep:
        refuse_replacing_plan(out_path, plan)
    command = (
        "elixir-tune search " + " ".join(shlex.quote(arg) for arg in sys.argv[2:])
        if len(sys.argv) > 1 and sys.argv[1] == "search"
        else f"elixir-tune search {args}"
    )
    prediction = plan.prediction
    assert prediction is not None, "search always writes a prediction"
    run_script, run_note = run_script_for(profile)
    header = (
        f"Written by `{command}`\n"
        f"on {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} from profile {profile_path} ({profile.name}) "
        f"and hardware {hardware_ref}.\n"
        f"Predicted: {prediction.step_time_s:.3g} s/step, {prediction.tokens_per_s:,.0f} tokens/s, "
        f"{prediction.tflops_per_gpu:.1f} TFLOPS/GPU, peak {gib(prediction.peak_gpu_bytes)} per GPU.\n"
        f"Why: {result.why}\n"
        f"Explain: elixir-tune show {out_path}\n"
        f"Run:     elixir-run {out_path} {run_script}" + (f"  # {run_note}" if run_note else "")
    )
    save_plan(plan, out_path, header=header)
    return run_script, run_note


def warn_cpu_oversubscription(device: str, gpus: int, runs_here: bool = False) -> None:
    """A CPU plan with more workers per node than this machine has cores: one warning line (the plan is still
    written: it may be meant for a bigger machine).

    Args:
        device: the plan's device (GPU plans are for other machines: no warning).
        gpus: the workers per node asked for.
        runs_here: the plan runs on this machine next (``elixir-tune train``), not perhaps elsewhere.
    """
    cores = os.cpu_count() or 1
    if device != "cpu" or gpus <= cores:
        return
    shared = f"--gpus {gpus} asks for {gpus} CPU worker processes per node, and this machine has {cores} core(s)"
    if runs_here:
        advice = f"the workers will share them and run several times slower than the plan predicts; give --gpus {cores}"
    else:
        advice = (
            "run here, the workers would share cores and run several times slower than the plan predicts; search "
            f"with --gpus {cores} or fewer for this machine (or search on the machine the plan is for)"
        )
    err_console.print(f"[yellow]warning[/]: {shared}: {advice}", soft_wrap=True)


def _draw(path: str, result, limit_bytes: int) -> None:
    """The best candidate and the runner-up on one SVG page."""
    from elixir_tune.costmodel.picture import picture_of, shape_title, write_svg

    pictures = []
    for rank, candidate in zip(("#1 best", "#2 runner-up"), result.candidates, strict=False):
        title = shape_title(rank, candidate.shape, candidate.step_time_s, candidate.memory.peak_gpu_bytes)
        pictures.append(picture_of(result.model_of(candidate), candidate.shape, title, limit_bytes))
    try:
        write_svg(path, pictures)
    except OSError as error:
        fail(f"cannot write {path}: {error}", hint="pass another path with --timeline")
