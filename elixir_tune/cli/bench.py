"""`elixir-tune bench PLAN...` and `elixir-tune search --measure`: plans measured on this machine.

Both run each plan for a few steps through ``elixir-run`` with the model's recipe (synthetic tokens
unless ``--data`` is given), in interleaved rounds within a time budget (``measure/trials.py``), and
print measured beside predicted step time and peak memory. ``search --measure`` then writes the
measured fastest plan that fits instead of the predicted fastest, and a hardware file recalibrated
from the measurements beside it (``measure/calibrate.py``).
"""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path
from types import SimpleNamespace

import click

from elixir_tune.cli.console import Table, console, fail, print_wide
from elixir_tune.cli.types import FiniteRange

DEFAULT_STEPS = 4
DEFAULT_ROUNDS = 2
DEFAULT_BUDGET_S = 600.0
DEFAULT_TOP = 3


def measure_options(function):
    """The options of ``search --measure``."""
    options = [
        click.option(
            "--measure",
            is_flag=True,
            help="Run the best few plans (and the peer engines' nearest) for a few steps here; write the "
            "measured fastest and a recalibrated hardware file.",
        ),
        click.option(
            "--measure-budget",
            type=FiniteRange(min=1),
            default=DEFAULT_BUDGET_S,
            show_default=True,
            metavar="SECONDS",
            help="No trial starts past this; a running one stops at it.",
        ),
        click.option(
            "--measure-top", type=click.IntRange(min=1), default=DEFAULT_TOP, show_default=True, help="Plans to try."
        ),
        click.option("--measure-steps", type=click.IntRange(min=2), default=DEFAULT_STEPS, show_default=True),
        click.option("--measure-rounds", type=click.IntRange(min=1), default=DEFAULT_ROUNDS, show_default=True),
        click.option("--data", default=None, help="Training data for the trials [default: synthetic tokens]."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def trial_script(profile, data: str | None) -> list[str]:
    """What ``elixir-run PLAN`` runs in a trial: the model's recipe, on ``data`` or synthetic tokens."""
    from elixir_tune.cli.run_script import run_script_for

    script, note = run_script_for(profile, shlex.quote(data) if data else "FILE")
    if script == "train.py":
        fail(f"cannot measure: {note}", hint="measure with your own script: elixir-run PLAN train.py")
    words = shlex.split(script)
    if "--steps" in words:  # the trial sets its own
        at = words.index("--steps")
        del words[at : at + 2]
    if words[0] == "finetune":
        if not data:
            fail("the model is fine-tuned from its weights: trials need --data FILE", hint="give --data FILE")
        if "--lora-rank" in words:  # the plan carries the LoRA settings
            words = words[: words.index("--lora-rank")]
        return words
    if data:
        return [*words, "--data", data]
    return words if "--synthetic" in words else [*words, "--synthetic"]


def run_trials(trials, steps: int, rounds: int, budget_s: float):
    """Measures the trials (``measure.trials.measure``) with a temporary folder for their logs."""
    from elixir_tune.measure.trials import measure

    with tempfile.TemporaryDirectory(prefix="elixir-measure-") as work:
        return measure(
            trials,
            steps=steps,
            warmup=1,
            rounds=rounds,
            budget_s=budget_s,
            work_dir=Path(work),
            say=lambda line: console.print(line, markup=False, soft_wrap=True),
        )


def results_table(measurement, title: str) -> Table:
    """Measured beside predicted, one row per plan."""
    from elixir_tune.measure.trials import summary_rows

    table = Table(title=title)
    for name in ("plan", "predicted ms", "measured ms", "x", "predicted MiB", "measured MiB", "status"):
        table.add_column(name, justify="left" if name in ("plan", "status") else "right", no_wrap=name != "status")
    for row in summary_rows(measurement):

        def ms(value):
            return f"{value * 1000:,.1f}" if value else "-"

        def mib(value):
            return f"{value / 2**20:,.0f}" if value else "-"

        ratio = row["step_time_ratio"]
        table.add_row(
            row["name"],
            ms(row["predicted_step_time_s"]),
            ms(row["measured_step_time_s"]),
            f"{ratio:.2f}" if ratio else "-",
            mib(row["predicted_peak_bytes"]),
            mib(row["measured_peak_bytes"]),
            row["status"],
        )
    return table


def _write_json(path: Path, measurement, extra: dict) -> None:
    from elixir_tune.measure.trials import summary_rows

    record = {"rounds_done": measurement.rounds_done, "elapsed_s": round(measurement.elapsed_s, 1), **extra}
    record["stopped"] = measurement.stopped
    record["plans"] = summary_rows(measurement)
    path.write_text(json.dumps(record, indent=1))


def measure_search(result, profile, hardware, hardware_ref: str, out_path: str, host_bytes: int, options: dict) -> None:
    """``search --measure``: trials of the search's best and the peers' nearest, the measured fastest
    written to ``out_path``, a recalibrated hardware file beside it, and a JSON record of the trials."""
    from elixir_tune.hardware.spec import save_hardware
    from elixir_tune.measure.calibrate import calibrated, spread, time_factor
    from elixir_tune.measure.plans import plans_to_measure, runner_missing
    from elixir_tune.measure.trials import Trial
    from elixir_tune.plan import save_plan

    out = Path(out_path)
    chosen = plans_to_measure(result, options["measure_top"], host_bytes)
    script = trial_script(profile, options["data"])
    folder = out.parent / f".{out.stem}.trials"
    folder.mkdir(parents=True, exist_ok=True)
    trials = []
    for index, item in enumerate(chosen):
        path = folder / f"plan-{index}.yaml"
        save_plan(item.plan, path, header=f"Trial plan {item.name} of `elixir-tune search --measure`.")
        prediction = item.plan.prediction
        trials.append(
            Trial(
                item.name,
                path,
                script,
                prediction.step_time_s if prediction else None,
                prediction.peak_gpu_bytes if prediction else None,
                item.engine,
                runner_missing(item.engine),
            )
        )
    measurement = run_trials(trials, options["measure_steps"], options["measure_rounds"], options["measure_budget"])
    title = f"measured on this machine: {measurement.rounds_done} round(s) in {measurement.elapsed_s:.0f} s"
    print_wide(results_table(measurement, title))
    if measurement.stopped:
        console.print(f"stopped early: {measurement.stopped}", markup=False, soft_wrap=True)
    usable = result.usable_gpu_bytes
    winner = measurement.fastest(lambda r: r.peak_bytes <= usable)
    extra: dict = {"hardware": hardware_ref}
    if winner is None:
        console.print(f"no trial ran to the end: {out_path} keeps the predicted fastest", markup=False)
    else:
        index = measurement.results.index(winner)
        item = chosen[index]
        header = (
            f"Written by `elixir-tune search --measure`: the measured fastest of the plans run on this machine, "
            f"{item.name}: {(winner.median_step_s or 0) * 1000:.1f} ms/step measured (median of "
            f"{len(winner.step_times_s)} steps), {item.plan.prediction.step_time_s * 1000:.1f} ms predicted.\n"
            f"Explain: elixir-tune show {out_path}"
        )
        save_plan(item.plan, out, header=header)
        extra["chosen"] = item.name
        console.print(f"wrote [bold]{out_path}[/]: {item.name}, the measured fastest that fits", soft_wrap=True)
    ratios = [r.ratio for r in measurement.results if r.ratio]
    if ratios:
        factor = time_factor(ratios)
        note = f"{len(ratios)} plan(s) measured by `elixir-tune search --measure`"
        hardware_path = out.with_name(f"{out.stem}.hardware.yaml")
        save_hardware(calibrated(hardware, factor, note), hardware_path, header=f"Recalibrated from {hardware_ref}.")
        extra.update(time_factor=factor, spread_after=spread(ratios, factor), calibrated_hardware=str(hardware_path))
        console.print(
            f"prediction vs measurement: steps ran {factor:.2f}x the predicted time (median over {len(ratios)} "
            f"plan(s); each plan within {spread(ratios, factor):.2f}x of that); wrote {hardware_path} with every rate "
            f"scaled by it: search again with --hardware {hardware_path}",
            markup=False,
            soft_wrap=True,
        )
    _write_json(out.with_name(f"{out.stem}.measured.json"), measurement, extra)


@click.command("bench")
@click.argument("plans", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--steps", type=click.IntRange(min=2), default=DEFAULT_STEPS, show_default=True, help="Steps per trial.")
@click.option("--rounds", type=click.IntRange(min=1), default=DEFAULT_ROUNDS, show_default=True)
@click.option("--budget", type=FiniteRange(min=1), default=DEFAULT_BUDGET_S, show_default=True, metavar="SECONDS")
@click.option("--data", default=None, help="Training data [default: synthetic tokens].")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Also write the results here.")
def bench_command(
    plans: tuple[str, ...], steps: int, rounds: int, budget: float, data: str | None, json_path: str | None
) -> None:
    """Run each PLAN for a few steps on this machine, in interleaved rounds; print measured beside predicted.

    The first step of each trial warms up and is left out; a plan's step time is the median over its
    rounds, its memory rank 0's peak (resident memory on the CPU). Ctrl-C stops the running trial and
    prints the results so far.

    \b
    Example:
        elixir-tune bench plan.yaml other.yaml --steps 6 --rounds 3
    """
    from elixir_tune.measure.plans import runner_missing
    from elixir_tune.measure.trials import Trial
    from elixir_tune.plan import load_plan

    if data and not Path(data).exists():  # every trial would fail on it, one start-up after another
        fail(f"--data {data}: no such file or directory", hint="give the training data's path, or leave --data out")
    trials = []
    for path in plans:
        try:
            plan = load_plan(path)
        except ValueError as error:
            fail(str(error), hint="give plans written by `elixir-tune search`")
        prediction = plan.prediction
        trials.append(
            Trial(
                path,
                Path(path),
                trial_script(_profile_of(plan), data),
                prediction.step_time_s if prediction else None,
                prediction.peak_gpu_bytes if prediction else None,
                plan.engine.name,
                runner_missing(plan.engine.name),
            )
        )
    measurement = run_trials(trials, steps, rounds, budget)
    print_wide(results_table(measurement, f"{measurement.rounds_done} round(s) in {measurement.elapsed_s:.0f} s"))
    if measurement.stopped:
        console.print(f"stopped early: {measurement.stopped}", markup=False, soft_wrap=True)
    if json_path:
        _write_json(Path(json_path), measurement, {})
    ran = [result for result in measurement.results if result.trial.skip_reason is None]
    if ran and all(result.failure and not result.step_times_s for result in ran):
        fail(f"every trial failed; the first: {ran[0].failure}", hint="run one plan with elixir-run to see it whole")


def _profile_of(plan):
    """What ``run_script_for`` reads of a profile: the plan's own when its file is there, else its model."""
    from elixir_tune.profiler.schema import load_profile

    profile_path = plan.search.profile if plan.search else ""
    if profile_path and Path(profile_path).is_file():
        try:
            return load_profile(profile_path)
        except ValueError:
            pass
    return SimpleNamespace(source=plan.model.source, lora=plan.model.lora, inputs=[], token_vocab=0)
