"""`elixir-tune search --train-tokens D`: the options and the output of time-to-train planning.

Not a command of its own: ``cli/search.py`` takes these options and hands over to ``run`` when
``--train-tokens`` is given. The work is ``search/time_to_train.py``; this file parses and prints.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from elixir_tune.cli.console import Table, console, err_console, fail, print_json, print_wide
from elixir_tune.cli.types import FiniteRange
from elixir_tune.hardware.networks import NETWORK_WORDS, NETWORKS

# Token counts: 300e9, 300B, 3.5T, 2M (SI: thousand, million, billion, trillion).
_TOKEN_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_tokens(text: str, option: str) -> float:
    """A token count from '300e9', '300B', '3.5T' or '2M'.

    Raises:
        click.BadParameter: not a positive count (names the option and the accepted forms).
    """
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]?)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _TOKEN_UNITS:
        raise click.BadParameter(f"{text!r}: expected a token count, e.g. 300e9, 300B or 3.5T", param_hint=option)
    try:
        value = float(match.group(1)) * _TOKEN_UNITS[unit]
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: expected a token count, e.g. 300e9, 300B or 3.5T", param_hint=option
        ) from None
    if value < 1:
        raise click.BadParameter(f"{text!r}: expected at least one token", param_hint=option)
    return value


def time_to_train_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The search command's time-to-train and network options."""
    options = [
        click.option(
            "--train-tokens",
            default=None,
            metavar="TOKENS",
            help="Plan a whole training run on this many tokens (300e9, 300B, 3.5T): the time, GPU-hours and "
            "cluster, over the sizes --max-gpus allows (or the --gpus/--nodes cluster) and the batches the "
            "scaling laws' batch limit allows.",
        ),
        click.option(
            "--max-gpus",
            type=click.IntRange(min=1),
            default=None,
            help="With --train-tokens: search clusters of 1, 2, 4, ... whole nodes up to this many GPUs.",
        ),
        click.option(
            "--objective",
            type=click.Choice(["time", "gpu-hours"]),
            default="time",
            show_default=True,
            help="With --train-tokens: the shortest run, or the fewest GPU-hours.",
        ),
        click.option(
            "--gpu-hour-price",
            type=FiniteRange(min=0),
            default=None,
            help="With --train-tokens: price of one GPU-hour, to show each run's cost.",
        ),
        click.option(
            "--batch-limit",
            default=None,
            metavar="TOKENS",
            help="With --train-tokens: the largest useful global batch in tokens [default: Kaplan et al. 2020's "
            "critical batch at the loss the run ends at, an estimate].",
        ),
        click.option(
            "--full-frontier",
            is_flag=True,
            help="With --train-tokens --objective time: search every cluster size (by default a size that even at the "
            "hardware's best MFU is slower than the best found is shown with that bound, not searched).",
        ),
        click.option(
            "--network",
            type=click.Choice(NETWORKS),
            default=None,
            help="Inter-node link preset in place of the hardware's: "
            + "; ".join(f"{name}: {words}" for name, words in NETWORK_WORDS.items())
            + " (each at 0.9 of line rate).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def run(
    *,
    profile: Any,
    profile_path: str,
    hardware: Any,
    hardware_ref: str,
    train_tokens_text: str,
    max_gpus: int | None,
    gpus: int | None,
    nodes: int | None,
    objective: str,
    gpu_hour_price: float | None,
    batch_limit_text: str | None,
    full_frontier: bool,
    global_batch_size: int | None,
    search_kwargs: dict[str, Any],
    out_path: str,
    as_json: bool,
    write_plan: Callable[..., tuple[str, str]],
) -> None:
    """Plans the run, writes the chosen cluster's plan and prints the answer and the frontier.

    ``write_plan`` is ``cli/search.py``'s (passed in: this module is imported by it).
    """
    from elixir_tune.search.time_to_train import time_to_train

    train_tokens = int(parse_tokens(train_tokens_text, "--train-tokens"))
    limit_tokens = parse_tokens(batch_limit_text, "--batch-limit") if batch_limit_text else None
    if max_gpus is None and gpus is None:
        fail(
            "--train-tokens needs the cluster",
            hint="give --max-gpus G to search cluster sizes, or --gpus N [--nodes M]",
        )
    fixed_cluster = max_gpus is None
    try:
        with err_console.status(f"planning {profile.name} on {train_tokens:.3g} tokens ...") as status:
            answer = time_to_train(
                profile,
                hardware,
                train_tokens,
                max_gpus=max_gpus,
                nodes=(nodes or 1) if fixed_cluster else None,
                gpus_per_node=gpus,
                objective=objective,
                batch_limit_tokens=limit_tokens,
                global_batch_size=global_batch_size,
                gpu_hour_price=gpu_hour_price,
                full_frontier=full_frontier,
                progress=lambda line: status.update(f"planning {profile.name}: searching {line} ..."),
                profile_path=str(Path(profile_path).resolve()),
                **search_kwargs,
            )
    except ValueError as error:
        fail(str(error), hint="see `elixir-tune search --help` for the accepted values")
    best = answer.best
    if best is None or best.result is None:
        problems = "; ".join(sorted({a.problem for a in answer.frontier if a.problem}))
        fail(
            f"no cluster size has a plan for {profile.name}: {problems}",
            hint="try more GPUs (--max-gpus) or --batch-limit",
        )
    assert best is not None and best.result is not None
    args = f"--train-tokens {train_tokens_text}" + (f" --max-gpus {max_gpus}" if max_gpus else f" --gpus {gpus}")
    run_script, run_note = write_plan(best.result, profile, profile_path, hardware_ref, out_path, args)
    rows = [a.row(gpu_hour_price) for a in answer.frontier]
    if as_json:
        print_json(
            {
                "plan": out_path,
                "objective": objective,
                "train_tokens": train_tokens,
                "batch_limit": vars(answer.limit) | {"describe": answer.limit.describe()},
                "elapsed_s": round(answer.elapsed_s, 3),
                "best": best.row(gpu_hour_price),
                "why": best.result.why,
                "frontier": rows,
            }
        )
        return
    print_wide(frontier_table(answer, f"{profile.name} on {train_tokens:,} tokens, {hardware.name}"))
    console.print(_answer_line(answer), soft_wrap=True)
    console.print(f"[bold]{answer.limit.describe()}[/]", soft_wrap=True)
    if search_kwargs.get("loop") == "plain":
        console.print(
            "the plain loop runs data parallelism with standard accumulation only: --loop forward_backward also "
            "tries pipeline, tensor and layered plans (the shipped recipes run it)",
            soft_wrap=True,
        )
    console.print(
        "the time counts training steps only: no data loading stalls, evaluation, checkpoints, failures or restarts",
        soft_wrap=True,
    )
    console.print(
        f"wrote [bold]{out_path}[/] for {best.nodes} x {best.gpus_per_node} GPUs; explain it with "
        f"`elixir-tune show {out_path}`, run it with `elixir-run {out_path} {run_script}`"
        + (f" ({run_note})" if run_note else ""),
        soft_wrap=True,
    )


def _answer_line(answer: Any) -> str:
    """The chosen run in one line."""
    best = answer.best
    cost = (
        f", {best.gpu_hours * answer.gpu_hour_price:,.0f} at {answer.gpu_hour_price:g}/GPU-hour"
        if answer.gpu_hour_price is not None
        else ""
    )
    return (
        f"[bold green]{'shortest' if answer.objective == 'time' else 'fewest GPU-hours'}:[/] {best.days:.3g} days on "
        f"{best.gpus} GPUs ({best.nodes} x {best.gpus_per_node}), {best.gpu_hours:,.0f} GPU-hours{cost}; "
        f"{best.steps:,} steps of {best.global_batch_size:,} samples ({best.batch_tokens:,} tokens), "
        f"{best.tokens_per_s:,.0f} tokens/s, layout {best.layout} (searched in {answer.elapsed_s:.1f} s)"
    )


def frontier_table(answer: Any, title: str) -> Table:
    """GPUs against days: what each cluster size of the frontier gives."""
    table = Table(title=title)
    priced = answer.gpu_hour_price is not None
    for name in ("GPUs", "nodes", "batch", "steps", "layout", "tokens/s", "MFU", "days", "GPU-hours"):
        table.add_column(name, justify="right", no_wrap=True)
    if priced:
        table.add_column("cost", justify="right", no_wrap=True)
    for item in answer.frontier:
        chosen = item is answer.best
        if item.ok:
            best = item.result.candidates[0]
            cells = [
                f"{item.global_batch_size:,}",
                f"{item.steps:,}",
                item.layout,
                f"{item.tokens_per_s:,.0f}",
                f"{best.mfu:.0%}",
                f"{item.days:.3g}",
                f"{item.gpu_hours:,.0f}",
            ] + ([f"{item.gpu_hours * answer.gpu_hour_price:,.0f}"] if priced else [])
        elif item.bound_s > 0 and item.problem.startswith("not searched"):
            bound_days = item.bound_s / 86400.0
            cells = [
                f"{item.global_batch_size:,}",
                f"{item.steps:,}",
                "not searched",
                "",
                "",
                f">= {bound_days:.3g}",
                "",
            ]
            cells += [""] if priced else []
        else:
            cells = [f"{item.global_batch_size:,}", "", item.problem.split(":")[0][:40], "", "", "", ""] + (
                [""] if priced else []
            )
        table.add_row(str(item.gpus), str(item.nodes), *cells, style="bold green" if chosen else None)
    return table
