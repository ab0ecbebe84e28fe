"""Short training runs of several plans on this machine, in interleaved rounds, within a time budget.

Each trial is a real ``elixir-run PLAN SCRIPT --steps N`` (its own process group, so that a stop ends
its workers too) whose recipe writes a JSON log of every step: the step's wall time and rank 0's peak
memory (device memory on a GPU, the process's resident memory on the CPU). Rounds interleave the
plans (each round runs each plan once, in an order rotated per round), so that a machine whose load
changes slows them alike. A plan's figure is the median step over its rounds after each trial's
warm-up steps. A trial is started only when its expected wall time (its last trial's, else the
slowest trial so far, else a first guess) fits in what is left of the budget; one still running at
the budget's end is stopped, and its steps logged so far count. Ctrl-C stops the trial running (its
process group) and keeps every result so far. A trial that fails is reported with its last output
line and left out. Imports no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

FIRST_TRIAL_GUESS_S = 30.0  # start-up of elixir-run and its workers before any step (~25 s on 2 loaded cores)
STOP_GRACE_S = 10.0  # after SIGTERM, before SIGKILL


@dataclass
class Trial:
    """One plan to measure.

    Attributes:
        name: how the report names it (e.g. ``#1 elixir`` or ``fsdp2 reshard``).
        plan_path: the plan file.
        script: what ``elixir-run PLAN`` runs (the recipe and its arguments).
        predicted_step_time_s: the plan's prediction (None without one).
        predicted_peak_bytes: the plan's predicted device peak per rank.
        engine: the engine that runs it.
        skip_reason: why it is not run at all (e.g. its engine's runner is missing); None to run it.
    """

    name: str
    plan_path: Path
    script: list[str]
    predicted_step_time_s: float | None
    predicted_peak_bytes: int | None
    engine: str = "elixir"
    skip_reason: str | None = None


@dataclass
class TrialResult:
    """What the trials of one plan measured.

    Attributes:
        trial: the plan.
        step_times_s: every timed step (warm-up steps left out), over all its rounds.
        peak_bytes: the largest peak memory of rank 0 over its steps.
        wall_s: wall time of each of its trials (start-up included).
        failure: why it failed (its last output line), or None.
    """

    trial: Trial
    step_times_s: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    wall_s: list[float] = field(default_factory=list)
    failure: str | None = None

    @property
    def median_step_s(self) -> float | None:
        return statistics.median(self.step_times_s) if self.step_times_s else None

    @property
    def ratio(self) -> float | None:
        """measured / predicted step time (None when either is missing)."""
        median, predicted = self.median_step_s, self.trial.predicted_step_time_s
        return median / predicted if median and predicted else None


@dataclass
class Measurement:
    """All trials of one measurement.

    Attributes:
        results: one per plan, in the order given.
        rounds_done: complete rounds.
        elapsed_s: wall time.
        stopped: why the measurement ended early ("" when every round ran).
    """

    results: list[TrialResult]
    rounds_done: int
    elapsed_s: float
    stopped: str = ""

    def fastest(self, fits: Callable[[TrialResult], bool]) -> TrialResult | None:
        """The measured fastest plan among those that ran and ``fits``."""
        ran = [r for r in self.results if r.median_step_s is not None and r.failure is None and fits(r)]
        return min(ran, key=lambda r: r.median_step_s or 0.0) if ran else None


def trial_command(trial: Trial, steps: int, log_path: Path) -> list[str]:
    """The ``elixir-run`` command line of one trial (this interpreter, so that this elixir-tune runs it)."""
    return [
        sys.executable,
        "-m",
        "elixir_tune.cli.run",
        str(trial.plan_path),
        *trial.script,
        "--steps",
        str(steps),
        "--log",
        str(log_path),
        "--print-every",
        str(steps),
    ]


def measure(
    trials: list[Trial],
    *,
    steps: int,
    warmup: int,
    rounds: int,
    budget_s: float,
    work_dir: Path,
    say: Callable[[str], None] = print,
) -> Measurement:
    """Runs the trials in interleaved rounds within ``budget_s`` seconds.

    Args:
        trials: the plans.
        steps: steps per trial (warm-up included).
        warmup: first steps of each trial left out of the figures.
        rounds: rounds (each runs every plan once).
        budget_s: no trial starts when its expected wall time exceeds what is left; a running one
            is stopped at the end.
        work_dir: where the trials' logs go.
        say: where progress lines go.

    Returns:
        What was measured (also after Ctrl-C: the results so far, ``stopped`` says so).
    """
    if steps <= warmup:
        raise ValueError(f"--steps {steps}: must exceed the {warmup} warm-up step(s) to time any step")
    started = time.perf_counter()
    results = [TrialResult(trial) for trial in trials]
    for result in results:
        if result.trial.skip_reason:
            result.failure = result.trial.skip_reason
            say(f"skipped {result.trial.name}: {result.trial.skip_reason}")
    runnable = [r for r in results if r.failure is None]
    measurement = Measurement(results, 0, 0.0)
    try:
        for round_index in range(rounds):
            shift = round_index % max(1, len(runnable))
            for result in runnable[shift:] + runnable[:shift]:
                if result.failure is not None:
                    continue
                left = budget_s - (time.perf_counter() - started)
                expected = _expected_wall_s(result, results, steps)
                if expected > left:
                    measurement.stopped = (
                        f"budget: {result.trial.name}'s next trial would take about {expected:.0f} s, "
                        f"{max(left, 0):.0f} s of the budget are left"
                    )
                    raise _BudgetSpent
                log = work_dir / f"trial-{results.index(result)}-round-{round_index}.json"
                _run_one(result, steps, warmup, log, left, say)
            measurement.rounds_done = round_index + 1
    except _BudgetSpent:
        pass
    except KeyboardInterrupt:
        measurement.stopped = "interrupted (Ctrl-C): the results so far are kept"
    measurement.elapsed_s = time.perf_counter() - started
    return measurement


class _BudgetSpent(Exception):
    """No further trial fits in the budget."""


def _expected_wall_s(result: TrialResult, results: list[TrialResult], steps: int) -> float:
    """A trial's expected wall time: its own last one, else the slowest so far, else a first guess."""
    if result.wall_s:
        return result.wall_s[-1]
    walls = [wall for other in results for wall in other.wall_s]
    if walls:
        return max(walls)
    return FIRST_TRIAL_GUESS_S + steps * (result.trial.predicted_step_time_s or 0.0)


def _run_one(
    result: TrialResult, steps: int, warmup: int, log: Path, left_s: float, say: Callable[[str], None]
) -> None:
    """One trial: run it (stopped at ``left_s``), then read its log into ``result``."""
    command = trial_command(result.trial, steps, log)
    say(f"running {result.trial.name}: {' '.join(command[3:])}")
    began = time.perf_counter()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=os.environ.copy(),
    )
    try:
        output, _ = process.communicate(timeout=max(left_s, 1.0))
        timed_out = False
    except subprocess.TimeoutExpired:
        output, timed_out = _stop(process), True
    except KeyboardInterrupt:
        _stop(process)
        _read_log(result, log, warmup)
        raise
    result.wall_s.append(time.perf_counter() - began)
    got = _read_log(result, log, warmup)
    if process.returncode != 0 and not timed_out:
        lines = [line for line in (output or "").splitlines() if line.strip()]
        result.failure = f"the run failed (exit {process.returncode}): {lines[-1] if lines else 'no output'}"
        say(f"  {result.trial.name} failed, left out: {result.failure}")
    elif timed_out:
        say(f"  {result.trial.name}: stopped at the budget's end after {got} timed step(s)")
    else:
        say(f"  {result.trial.name}: {got} timed step(s), median so far {(result.median_step_s or 0) * 1000:.1f} ms")


def _stop(process: subprocess.Popen) -> str:
    """Ends a trial's process group (SIGTERM, then SIGKILL) and returns what it printed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        output, _ = process.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    return output or ""


def _read_log(result: TrialResult, log: Path, warmup: int) -> int:
    """Adds a trial's timed steps and peak memory from its JSON log; the number of timed steps."""
    try:
        steps = json.loads(log.read_text()).get("steps", [])
    except (OSError, ValueError):
        return 0
    timed = steps[warmup:]
    result.step_times_s.extend(float(step["step_time_s"]) for step in timed)
    result.peak_bytes = max([result.peak_bytes, *(int(step.get("memory_bytes", 0)) for step in steps)])
    return len(timed)


def summary_rows(measurement: Measurement) -> list[dict]:
    """One JSON-able row per plan: predicted and measured step time and peak memory, their ratios, status."""
    rows = []
    for result in measurement.results:
        trial = result.trial
        rows.append(
            {
                "name": trial.name,
                "engine": trial.engine,
                "plan": str(trial.plan_path),
                "predicted_step_time_s": trial.predicted_step_time_s,
                "measured_step_time_s": result.median_step_s,
                "step_time_ratio": result.ratio,
                "timed_steps": len(result.step_times_s),
                "predicted_peak_bytes": trial.predicted_peak_bytes,
                "measured_peak_bytes": result.peak_bytes or None,
                "status": result.failure or ("ran" if result.step_times_s else "not run"),
            }
        )
    return rows
