"""`elixir-tune train MODEL --data FILE --gpus N [RECIPE_OPTIONS]`: profile, search and run in one command.

The three steps behind it stay as they are (``profile``, ``search``, ``elixir-run``) for clusters and for plans
kept in a repository; this is the common case on one machine. The profile and the plan are cached by what
decides them (``elixir_tune.run_cache``), so the second run of the same settings starts training at once. The
plan is printed in three lines, then elixir-run replaces this process (Ctrl-C, exit status and output are
elixir-run's own).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import click

from elixir_tune.cli.console import EXIT_USAGE, console, err_console, fail, print_json
from elixir_tune.cli.profile import MODEL_HINT
from elixir_tune.cli.types import FiniteRange
from elixir_tune.units import gib

PROFILE_BATCH_SIZE = 8  # the micro-batch traced (the profile gives activations at any micro-batch from two)


@click.command(
    "train",
    context_settings={"ignore_unknown_options": True, "help_option_names": ["-h", "--help"]},
)
@click.argument("model")
@click.option("--data", default=None, help="Training data: a text, JSONL, Parquet or CSV file (fine-tune) or text.")
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    default=None,
    help="Workers on this machine [default: its GPUs, or 1 on a machine without].",
)
@click.option(
    "--hardware",
    "hardware_ref",
    default=None,
    help="Preset id or probe file [default: ./hardware.yaml, else the 'cpu' preset on a machine without GPUs].",
)
@click.option("--seq-len", type=click.IntRange(min=2), default=None, help="Tokens per row [default: the profile's].")
@click.option("--global-batch-size", type=click.IntRange(min=1), default=None, help="Rows per optimizer step.")
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "bf16", "fp16"], case_sensitive=False),
    default=None,
    help="Compute dtype [default: bf16 on GPUs, fp32 on the CPU].",
)
@click.option("--lora-rank", type=click.IntRange(min=1), default=None, help="Train LoRA adapters of this rank.")
@click.option("--lora-alpha", type=FiniteRange(min=0, min_open=True), default=None, help="LoRA alpha.")
@click.option("--lora-targets", default=None, help="Modules to adapt, e.g. q_proj,v_proj.")
@click.option("--plan-out", type=click.Path(dir_okay=False), default=None, help="Also write the plan used here.")
@click.option("--dry-run", is_flag=True, help="Profile and search (or reuse them), print the plan and the command.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print the plan file and the command as JSON.")
@click.argument("recipe_args", nargs=-1, type=click.UNPROCESSED, metavar="[RECIPE_OPTIONS]...")
def train_command(
    model: str,
    data: str | None,
    gpus: int | None,
    hardware_ref: str | None,
    seq_len: int | None,
    global_batch_size: int | None,
    dtype: str | None,
    lora_rank: int | None,
    lora_alpha: float | None,
    lora_targets: str | None,
    plan_out: str | None,
    dry_run: bool,
    as_json: bool,
    recipe_args: tuple[str, ...],
) -> None:
    """Profile MODEL, search a plan for this machine and train it, in one command.

    A Hugging Face model (a directory, or a Hub name in the local cache) is fine-tuned on --data with the
    finetune recipe; another model (a config name, a model YAML or .py) is trained from scratch with the pretrain
    recipe. Options this command does not know go to the recipe (see `elixir-run PLAN finetune --help`). The
    profile and the plan are cached by the model's files and the settings, and reused when they match.

    \b
    Examples:
        elixir-tune train path/to/model --data chat.jsonl --epochs 1 --save-pretrained out
        elixir-tune train path/to/model --data chat.jsonl --lora-rank 8 --lora-targets q_proj,v_proj --steps 200
        elixir-tune train gpt2-tiny --gpus 2 --steps 50
        elixir-tune train path/to/model --data chat.jsonl --gpus 4 --hardware h100-80gb-sxm --dry-run
    """
    if as_json and not dry_run:  # a run's output is its training log, not one document
        fail("--json goes with --dry-run", hint="add --dry-run, or drop --json", code=EXIT_USAGE)
    if data is not None and not Path(data).exists():  # before any heavy import: an answer at once
        fail(f"--data {data}: no such file", hint="give the training data's path", code=EXIT_USAGE)
    if lora_rank is None and (lora_alpha is not None or lora_targets is not None):
        fail("--lora-alpha and --lora-targets need --lora-rank", hint="add --lora-rank R (e.g. 8)", code=EXIT_USAGE)
    from elixir_tune import run_cache

    files = run_cache.model_files(model)
    if not files:
        fail(f"{model}: no such model", MODEL_HINT + "; a Hub name must be in the local cache", code=EXIT_USAGE)

    from elixir_tune.device import cuda_available, cuda_device_count

    cuda = cuda_available()
    gpus = gpus or (cuda_device_count() if cuda else 1)
    dtype = (dtype or ("bf16" if cuda else "fp32")).lower()
    hardware_ref = _hardware(hardware_ref, cuda)
    lora = (
        {"rank": lora_rank, "alpha": lora_alpha, "dropout": 0.0, "target_modules": lora_targets} if lora_rank else None
    )

    profile, profile_file, profile_reused = _profile(model, files, seq_len, dtype, lora)
    plan, plan_file, plan_reused = _plan(profile, profile_file, hardware_ref, gpus, global_batch_size)
    from elixir_tune.cli.run_script import run_script_for
    from elixir_tune.cli.search import warn_cpu_oversubscription

    warn_cpu_oversubscription(plan.cluster.device, gpus, runs_here=True)
    if plan_out:
        Path(plan_out).write_text(plan_file.read_text())
    reused = " and ".join(what for what, hit in (("profile", profile_reused), ("plan", plan_reused)) if hit)
    if not as_json:
        for line in plan_lines(plan):
            console.print(line, markup=False, soft_wrap=True)
        console.print(
            f"plan file: {plan_out or plan_file}" + (f" (cached {reused} reused)" if reused else ""),
            markup=False,
            soft_wrap=True,
        )

    script, note = run_script_for(profile, shlex.quote(data) if data else "")
    if script == "train.py":
        fail(f"{model}: {note}", hint=f"run your script with `elixir-run {plan_out or plan_file} train.py`")
    words = shlex.split(script)
    if words[0] == "finetune":  # the plan carries the LoRA settings: the recipe takes them from it
        words = words[: words.index("--lora-rank")] if "--lora-rank" in words else words
        if not data:
            words = words[: words.index("--data")]
    elif data:
        words += ["--data", data]
    argv = [str(plan_out or plan_file), *words, *recipe_args]
    if as_json:
        command = ["elixir-run", *argv]
        print_json(
            {
                "profile_file": str(profile_file),
                "plan_file": str(plan_out or plan_file),
                "reused": reused,
                "command": command,
            }
        )
        return
    # The same job later, or on a cluster, without this command: the line to keep.
    console.print(("" if dry_run else "running: ") + "elixir-run " + shlex.join(argv), markup=False, soft_wrap=True)
    if dry_run:
        return
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "elixir_tune.cli.run", *argv])


def _hardware(hardware_ref: str | None, cuda: bool) -> str:
    """The hardware the search prices: the option, ./hardware.yaml, or the cpu preset on a machine without GPUs."""
    if hardware_ref:
        return hardware_ref
    if Path("hardware.yaml").is_file():
        return str(Path("hardware.yaml").resolve())
    if not cuda:
        return "cpu"
    fail(
        "which GPUs? no --hardware given and no hardware.yaml here",
        hint="run `elixir-tune probe` once (it measures this machine into hardware.yaml), or pass a preset such as "
        "--hardware h100-80gb-sxm",
        code=EXIT_USAGE,
    )


def _profile(model: str, files: list[Path], seq_len: int | None, dtype: str, lora: dict | None):
    """The model's profile: the cached one for these files and settings, else a new one (then cached)."""
    from elixir_tune import run_cache
    from elixir_tune.profiler import ModelSourceError, load_profile, profile_model, save_profile

    settings = {"model": model, "batch": PROFILE_BATCH_SIZE, "seq_len": seq_len, "dtype": dtype, "lora": lora}
    path = run_cache.profile_path(run_cache.digest(settings, files))
    if path.is_file():
        try:
            return load_profile(path), path, True
        except ValueError:  # written by another elixir-tune, or damaged: made again below
            pass
    try:
        with err_console.status(f"profiling {model}") as status:
            profile = profile_model(
                model,
                batch_size=PROFILE_BATCH_SIZE,
                seq_len=seq_len,
                dtype=dtype,
                checkpointing="all",
                progress=status.update,
                lora=lora,
            )
    except ModelSourceError as error:
        fail(str(error), MODEL_HINT)
    _write(path, lambda partial: save_profile(profile, partial))
    return profile, path, False


def _plan(profile, profile_file: Path, hardware_ref: str, gpus: int, global_batch_size: int | None):
    """The plan for this profile, hardware and batch: the cached one, else a new search (then cached)."""
    from elixir_tune import run_cache
    from elixir_tune.cli.search import warn_loaded_hardware
    from elixir_tune.hardware import load_hardware, preset_path
    from elixir_tune.plan import load_plan, save_plan
    from elixir_tune.search import InfeasibleError, search

    hardware_file = Path(hardware_ref) if Path(hardware_ref).is_file() else preset_path(hardware_ref)
    settings = {"hardware": hardware_ref, "gpus": gpus, "global_batch_size": global_batch_size}
    key = run_cache.digest(settings, [profile_file] + ([hardware_file] if hardware_file.is_file() else []))
    path = run_cache.plan_path(key)
    if path.is_file():
        try:
            return load_plan(path), path, True
        except ValueError:  # PlanError: written by another elixir-tune, or damaged: searched again below
            pass
    try:
        hardware = load_hardware(hardware_ref)
        warn_loaded_hardware(hardware, hardware_ref)
        with err_console.status(f"searching plans for {profile.name} on {gpus} x {hardware.name}"):
            result = search(
                profile,
                hardware,
                gpus_per_node=gpus,
                global_batch_size=global_batch_size,
                hardware_id=hardware_ref,
                profile_path=str(profile_file),
            )
    except InfeasibleError as error:
        message, _, hint = str(error).partition("; try: ")
        fail(message, hint="try " + hint if hint else "")
    except (ValueError, FileNotFoundError) as error:
        fail(str(error), hint="see `elixir-tune train --help` for the accepted values")
    header = f"Written by `elixir-tune train {profile.source} --gpus {gpus} --hardware {hardware_ref}`."
    _write(path, lambda partial: save_plan(result.plan, partial, header=header))
    return result.plan, path, False


def _write(path: Path, write) -> None:
    """Writes a cache file whole or not at all (a second run never reads half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(partial)
    partial.replace(path)


def plan_lines(plan) -> list[str]:
    """A plan in three lines: the job, where the memory goes, what the cost model predicts.

    Args:
        plan: a plan with a prediction (``search`` writes one).

    Returns:
        Three lines of plain text.
    """
    training, memory, prediction = plan.training, plan.memory, plan.prediction
    lora = f", LoRA rank {plan.model.lora['rank']}" if plan.model.lora else ""
    ordinary = [chunk for chunk in memory.chunks if not chunk.resident]
    offloaded = sum(chunk.offload for chunk in memory.chunks)
    every = training.activation_checkpointing.every
    checkpointing = {0: "no activation checkpointing", 1: "every block checkpointed"}.get(
        every, f"every {every}th block checkpointed"
    ) + (" selectively" if every and training.activation_checkpointing.mode == "selective" else "")
    return [
        f"plan: {plan.model.name or plan.model.source} ({plan.model.num_params:,} params{lora}) on "
        f"{plan.world_size} {plan.cluster.device} worker(s), {plan.cluster.hardware}: global batch "
        f"{training.global_batch_size} = micro-batch {training.micro_batch_size} x accumulation "
        f"{training.grad_accum_steps} x data {plan.data_parallel_size}, seq {training.seq_len}, {training.dtype}",
        f"memory: {min(memory.cache_blocks, len(ordinary))} of {len(ordinary)} chunk(s) gathered at once, "
        f"{offloaded} of {len(memory.chunks)} offloaded to the host, {checkpointing}; peak "
        f"{gib(prediction.peak_gpu_bytes)} per worker, host {gib(prediction.peak_host_bytes)}",
        f"predicted: {prediction.step_time_s * 1000:,.1f} ms/step, {prediction.tokens_per_s:,.0f} tokens/s, "
        f"MFU {prediction.mfu:.1%} (each run ends with the measured figures beside these)",
    ]
