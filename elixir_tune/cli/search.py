"""`elixir-tune search --gpus N`: the fastest plan that fits, and a table of the best candidates."""

from __future__ import annotations

import os
import re
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import click

from elixir_tune.cli import time_to_train
from elixir_tune.cli.console import Table, console, err_console, fail, print_json, print_wide
from elixir_tune.cli.time_to_train import time_to_train_options
from elixir_tune.hardware.networks import with_network
from elixir_tune.hf_cache import looks_like_hub_name
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


def layout_label(row: dict) -> str:
    """The parallel layout of a candidate row: dp, or pp/tp/ep degrees (e.g. ``pp2 tp4/2d``, ``ep4``)."""
    parts = []
    if row.get("pipeline", 1) > 1:
        parts.append(f"pp{row['pipeline']}")
    if row.get("tensor", 1) > 1:
        parts.append(f"tp{row['tensor']}" + ("/2d" if row.get("tensor_mode") == "2d" else ""))
    if row.get("expert", 1) > 1:
        parts.append(f"ep{row['expert']}")
    return " ".join(parts) or "dp"


def candidates_table(rows: list[dict], title: str) -> Table:
    """The best candidates as a rich table (rows from ``Candidate.row``)."""
    table = Table(title=title)
    # The layout column only when some candidate uses pipeline or tensor parallelism.
    parallel = any(layout_label(row) != "dp" for row in rows)
    table.add_column("#", justify="right", no_wrap=True)
    if parallel:
        table.add_column("parallel", justify="right", no_wrap=True)
    for name in (
        "chunk MiB",
        "cache",
        "offloaded",
        "ckpt",
        "micro x accum (L: layered)",
        "step s",
        "tokens/s",
        "TFLOPS/GPU",
        "MFU",
        "GPU GiB",
        "host GiB",
    ):
        table.add_column(name, justify="right", no_wrap=True)
    for rank, row in enumerate(rows, 1):
        every = row["checkpointing"]
        table.add_row(
            str(rank),
            *([layout_label(row)] if parallel else []),
            f"{row['chunk_mib']:.3g}",
            f"{row['cache_blocks']}/{row['cacheable_chunks']}",
            f"{row['offload']:.0%}",
            "none" if every == 0 else "all" if every == 1 else f"1/{every}",
            f"{row['micro_batch_size']} x {row['grad_accum_steps']}{' L' if row.get('accumulation') == 'layered' else ''}",
            f"{row['step_time_s']:.3g}",
            f"{row['tokens_per_s']:,.0f}",
            f"{row['tflops_per_gpu']:.3g}",
            f"{row['mfu']:.0%}",
            f"{row['peak_gpu_bytes'] / 2**30:.3g}",
            f"{row['peak_host_bytes'] / 2**30:.3g}",
            style="bold green" if rank == 1 else None,
        )
    return table


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
    "pipeline=<stages>, assignment=modular|contiguous, schedule=looped_bfs|1f1b, tensor=<degree>, tensor_mode=1d|2d, expert=<degree>.",
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
    "--timeline",
    "timeline_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Also draw the predicted step of the best plan and the runner-up to this SVG file.",
)
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
    timeline_path: str | None,
    train_tokens: str | None,
    max_gpus: int | None,
    objective: str,
    gpu_hour_price: float | None,
    batch_limit: str | None,
    full_frontier: bool,
    network: str | None,
    as_json: bool,
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
            write_plan=write_plan,
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
            )
    except InfeasibleError as error:
        message, _, hint = str(error).partition("; try: ")
        fail(message, hint="try " + hint if hint else "")
    except ValueError as error:
        fail(str(error), hint="see `elixir-tune search --help` for the accepted values")
    plan = result.plan
    prediction = plan.prediction
    assert prediction is not None, "search always writes a prediction"
    run_script, run_note = write_plan(result, profile, profile_path, hardware_ref, out_path, f"--gpus {gpus}")
    if timeline_path:
        _draw(timeline_path, result, result.usable_gpu_bytes)
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


def write_plan(result, profile, profile_path: str, hardware_ref: str, out_path: str, args: str) -> tuple[str, str]:
    """Validates the search's plan and writes it with a header that says how it was made and run.

    Args:
        result: the ``SearchResult`` whose plan is written.
        profile: the model profile.
        profile_path: its file (named in the header).
        hardware_ref: the hardware preset or file (named in the header).
        out_path: where to write.
        args: the search's arguments, when this process was not started as ``elixir-tune search``.

    Returns:
        (the script ``elixir-run`` runs, why when it is not a recipe's plain command).
    """
    plan = result.plan
    problems = validate(plan)
    if problems:  # a bug, not a user error: say so plainly
        fail("the search produced an invalid plan: " + "; ".join(problems))
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


# What the pretrain recipe hands the model: the forward must take these (and may take the optional ones).
PRETRAIN_INPUTS = {"input_ids", "labels"}
OPTIONAL_INPUTS = {"attention_mask", "position_ids"}
BYTE_VOCAB = 256  # pretrain's text tokens are bytes


def run_script_for(profile, data: str = "FILE") -> tuple[str, str]:
    """What ``elixir-run PLAN`` runs for the profiled model: SCRIPT and its arguments, and why when it is not
    a recipe's plain command (``pretrain_command``).

    A Hugging Face model (a directory or a cached Hub name) is fine-tuned from its weights; other models train
    from scratch. Recipe names work from any directory, so the model path is made absolute.

    Args:
        profile: the model's profile.
        data: what ``--data`` names for a fine-tune.

    Returns:
        (SCRIPT and its arguments, a note or "").
    """
    source_dir = Path(str(profile.source))
    if source_dir.is_dir() and (source_dir / "config.json").is_file():
        script = f"finetune --model {shlex.quote(str(source_dir.resolve()))} --data {data}"
    elif looks_like_hub_name(str(profile.source)):
        script = f"finetune --model {shlex.quote(str(profile.source))} --data {data}"
    else:
        return pretrain_command(profile)
    if profile.lora:  # the plan carries them; printed so that the command says what it trains
        from elixir_tune.recipes.finetune_options import lora_flags

        script += " " + lora_flags(profile.lora)
    return script, ""


def pretrain_command(profile) -> tuple[str, str]:
    """What runs a model trained from scratch: the pretrain recipe when the model takes what it feeds
    (input_ids and labels; bytes of text need a vocabulary of 256), else the user's own script.

    Returns:
        (SCRIPT and its arguments for ``elixir-run PLAN``, a note on why it is not the recipe, or "").
    """
    inputs = set(profile.inputs)
    if inputs and not (PRETRAIN_INPUTS <= inputs <= PRETRAIN_INPUTS | OPTIONAL_INPUTS):
        return "train.py", (
            f"your own training script: the model takes {', '.join(profile.inputs)}, and the pretrain recipe feeds "
            "input_ids and labels only; elixir_tune.setup(model, optimizer) in the script reads the plan"
        )
    if 0 < profile.token_vocab < BYTE_VOCAB:
        return "pretrain --synthetic --steps 100", (
            f"random tokens: the model's vocabulary of {profile.token_vocab} cannot hold the recipe's byte tokens"
        )
    return "pretrain", ""


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
