"""`elixir-run PLAN SCRIPT [SCRIPT_ARGS...]`: check a plan against this machine, then run torchrun."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import click

from elixir_tune.cli.console import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    console,
    err_console,
    escape,
    fail,
    print_json,
)
from elixir_tune.cli.types import FiniteRange
from elixir_tune.launcher import (
    ArgvError,
    LaunchSpec,
    SlurmError,
    check_launch,
    compose_torchrun_argv,
    failed,
    format_command,
    observe_machine,
    read_allocation,
    run_torchrun,
    script_is_a_file,
    split_command_line,
    torchrun_option_arity,
    worker_env,
)
from elixir_tune.launcher.argv import option_name
from elixir_tune.launcher.env import COLLECTIVE_TIMEOUT_ENV, bootstrap_env
from elixir_tune.launcher.launch import lost_node_outcome
from elixir_tune.launcher.rendezvous import RendezvousWaitError, roll_call
from elixir_tune.launcher.watch import WorkerWatch
from elixir_tune.plan import PlanError, load_plan
from elixir_tune.profiler.plan_match import plan_profile_problems, profile_beside
from elixir_tune.recipes import RECIPES, UnknownRecipeError, is_recipe_name, recipe_module
from elixir_tune.recipes import preflight as recipe_preflight

_MARK = {True: "[green]ok[/]", False: "[red]FAIL[/]"}


@click.command(
    "elixir-run",
    context_settings={
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
        "help_option_names": ["-h", "--help"],
    },
)
@click.option(
    "--nnodes",
    type=click.IntRange(min=1),
    default=None,
    help="Nodes taking part (default: the SLURM allocation's, else the plan's cluster.nodes).",
)
@click.option(
    "--node-rank",
    type=click.IntRange(min=0),
    default=None,
    help="This node's rank, different on each node (default 0, or SLURM_NODEID; checked against "
    "--nnodes; the c10d rendezvous assigns the global ranks).",
)
@click.option(
    "--rdzv-endpoint",
    metavar="HOST:PORT",
    default=None,
    help="c10d rendezvous on node 0, the same on every node (needed for several nodes; under SLURM "
    "the allocation's first host, port 29400 or $ELIXIR_TUNE_RDZV_PORT).",
)
@click.option(
    "--rdzv-id", default=None, help="Job id shared by all nodes (default: SLURM's job id, else from the plan)."
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Restarts of the worker group after a failure.",
)
@click.option(
    "--rdzv-timeout",
    "rdzv_timeout_s",
    type=FiniteRange(min=0, min_open=True),
    default=300,
    show_default=True,
    metavar="SECONDS",
    help="With several nodes (or --rdzv-endpoint): how long to wait for every node at the rendezvous; "
    "then elixir-run names the missing nodes and stops. It prints a line every 10 s while it waits.",
)
@click.option(
    "--collective-timeout",
    "collective_timeout_s",
    type=FiniteRange(min=0, min_open=True),
    default=300,
    show_default=True,
    envvar=COLLECTIVE_TIMEOUT_ENV,
    metavar="SECONDS",
    help="How long a worker's collective waits for the other ranks before it fails, and how long a "
    "worker may stay stopped before elixir-run kills it; the job then ends naming the rank that "
    f"stopped answering (also ${COLLECTIVE_TIMEOUT_ENV}).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Run a plan whose predicted host or GPU memory exceeds this node's (a warning instead of a refusal).",
)
@click.option("--dry-run", is_flag=True, help="Print the checks and the exact torchrun command; start nothing.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print the checks and command as JSON.")
@click.argument(
    "command_line", nargs=-1, type=click.UNPROCESSED, metavar="[TORCHRUN_OPTIONS] PLAN SCRIPT [SCRIPT_ARGS]..."
)
def run_command(
    nnodes: int | None,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    rdzv_id: str | None,
    max_restarts: int,
    rdzv_timeout_s: float,
    collective_timeout_s: float,
    force: bool,
    dry_run: bool,
    as_json: bool,
    command_line: tuple[str, ...],
) -> None:
    """Check a plan against this machine and run SCRIPT under torchrun as the plan says.

    SCRIPT is a recipe shipped with elixir-tune (finetune, pretrain; its inputs are checked before any
    worker starts) or the path of your own Python file. The plan decides the processes per node
    (cluster.gpus_per_node); SCRIPT reads the plan from $ELIXIR_TUNE_PLAN (elixir_tune.setup does). Other torchrun options (e.g. --monitor-interval=1,
    --redirects 3, --log-dir DIR) go after elixir-run's own options and before PLAN. The exit
    status is the job's: 0, the failed worker's code, or 128 + the signal that ended it (130 for
    Ctrl-C, 143 for SIGTERM, after a recipe with --save saved; 137 for a worker's SIGKILL).

    Faults end the job with a message, never a silent wait: a plan that needs more memory than this
    node has is refused (--force runs it anyway); a rendezvous port held by another program is
    reported at once; a node missing at the rendezvous is named after --rdzv-timeout; a rank that
    stops answering is named after --collective-timeout; the workers die with elixir-run (even
    when it is killed with SIGKILL).

    \b
    Examples:
        elixir-run plan.yaml pretrain --steps 20
        elixir-run plan.yaml finetune --model path/to/model --data corpus.txt --epochs 1
        elixir-run --dry-run plan.yaml pretrain
        # give up on a missing node after 2 minutes, on a silent rank after 10
        elixir-run --rdzv-timeout 120 --collective-timeout 600 plan.yaml train.py
        # two nodes: the same command on each, --node-rank 0 and 1
        elixir-run --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29400 plan.yaml train.py
        # inside a SLURM allocation, once per node: nodes, rank and endpoint come from SLURM
        srun --ntasks-per-node=1 elixir-run plan.yaml train.py
    """
    if as_json and not dry_run:
        fail("--json goes with --dry-run (a running job's output is the workers' own)", code=EXIT_USAGE)
    try:
        # torchrun's parser (which loads torch, seconds) only when torchrun options come before PLAN.
        leading_option = bool(command_line) and command_line[0].startswith("-") and command_line[0] != "--"
        arity = torchrun_option_arity() if leading_option else {}
        torchrun_options, plan_path, script, script_args = split_command_line(command_line, arity)
    except ArgvError as error:
        fail(
            str(error),
            hint="usage: elixir-run [OPTIONS] [TORCHRUN_OPTIONS] PLAN SCRIPT [SCRIPT_ARGS]...; see elixir-run --help",
            code=EXIT_USAGE,
        )
    _refuse_unknown_options(torchrun_options, arity)

    try:
        plan = load_plan(plan_path)
    except PlanError as error:
        if len(error.problems) == 1 and error.problems[0].startswith("this is a "):  # a profile or hardware file
            fail(
                f"{plan_path}: " + error.problems[0].replace("FILE", plan_path),
                hint="PLAN is the file `elixir-tune search` writes (plan.yaml unless --out names another)",
                code=EXIT_USAGE,
            )
        fail(
            f"{plan_path} is not a usable plan: {error.problems[0]}"
            if len(error.problems) == 1
            else f"{plan_path} is not a usable plan ({len(error.problems)} problem(s)):\n"
            + "\n".join(f"  - {problem}" for problem in error.problems),
            hint=f"`elixir-tune validate {plan_path}` lists the problems; `elixir-tune search ... --out "
            f"{plan_path}` writes a fresh plan",
        )
    _refuse_plan_against_profile(plan, plan_path)
    if script_is_a_file(torchrun_options) and is_recipe_name(script) and not os.path.isfile(script):
        torchrun_options, script = _recipe(script, script_args, plan_path, torchrun_options)
    elif script_is_a_file(torchrun_options) and not os.path.isfile(script):
        fail(
            f"training script not found: {script}",
            hint="give the path of a Python file, or a recipe name: " + ", ".join(RECIPES),
        )

    try:
        allocation = read_allocation(os.environ)
    except SlurmError as error:
        fail(str(error), hint="or pass --nnodes, --node-rank and --rdzv-endpoint yourself")
    if allocation is not None:
        # Explicit flags win over the allocation, which wins over the plan.
        nnodes = allocation.nnodes if nnodes is None else nnodes
        node_rank = allocation.node_rank if node_rank is None else node_rank
        if nnodes > 1:
            rdzv_endpoint = rdzv_endpoint or allocation.rdzv_endpoint
            rdzv_id = rdzv_id or allocation.rdzv_id
    nnodes = plan.cluster.nodes if nnodes is None else nnodes
    node_rank = 0 if node_rank is None else node_rank
    facts = observe_machine()
    checks = check_launch(plan, facts, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, force=force)
    spec = LaunchSpec(
        nproc_per_node=plan.cluster.gpus_per_node,
        script=script,
        script_args=script_args,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=max_restarts,
        rdzv_id=rdzv_id or f"elixir-{plan.model.fingerprint[:12]}",
        torchrun_options=torchrun_options,
        bootstrap=True,
        rdzv_timeout_s=rdzv_timeout_s,
    )
    argv = compose_torchrun_argv(spec)
    env = worker_env(
        plan,
        plan_path,
        facts.cpu_cores,
        os.environ,
        collective_timeout_s=collective_timeout_s,
        max_restarts=max_restarts,
    )
    command = format_command(argv, env)
    problems = failed(checks)

    if dry_run and as_json:
        print_json(
            {
                "plan": plan_path,
                "ok": not problems,
                "command": command,
                "torchrun_argv": argv,
                "env": env,
                "checks": [vars(check) for check in checks],
                "slurm": None if allocation is None else vars(allocation),
            }
        )
        raise SystemExit(EXIT_FAILED if problems else EXIT_OK)
    _print_summary(plan, plan_path, checks, nnodes, node_rank)
    if allocation is not None:
        console.print(
            f"  SLURM {allocation.rdzv_id}: node {node_rank} of {nnodes}, rendezvous {rdzv_endpoint or 'local'}",
            markup=False,
        )
    if dry_run:
        console.print("[bold]command[/] (what elixir-run runs in-process):")
        console.print(command, markup=False, soft_wrap=True)
    if problems:
        fail(
            f"{plan_path} cannot run here: " + "; ".join(f"{check.name}: {check.detail}" for check in problems),
            hint=" | ".join(check.hint for check in problems if check.hint),
        )
    if dry_run:
        raise SystemExit(EXIT_OK)

    if force and failed(checks, fatal=False):
        say("--force: running although the plan does not fit this node (see the warnings above)")
    _launch(spec, env, plan, rdzv_timeout_s, collective_timeout_s)


def _refuse_plan_against_profile(plan, plan_path: str) -> None:
    """The check ``elixir-tune validate`` makes against the plan's profile, before any worker starts."""
    raw = plan.to_dict()
    profile, _ = profile_beside(raw, plan_path)
    problems = plan_profile_problems(raw, profile) if profile else []
    if problems:
        fail(
            f"{plan_path} does not match its model's profile: " + "; ".join(problems),
            hint=f"`elixir-tune validate {plan_path}` lists them; `elixir-tune search --profile "
            f"{plan.search.profile}` writes a plan that matches",
        )


def _recipe(name: str, script_args: list[str], plan_path: str, torchrun_options: list[str]) -> tuple[list[str], str]:
    """A recipe name: its preflight in this process (one line per problem, nothing started), then its module."""
    try:
        module = recipe_module(name)
    except UnknownRecipeError as error:
        fail(str(error), code=EXIT_USAGE)
    problems = recipe_preflight(name, list(script_args), plan_path)
    if problems:
        for problem in problems[:-1]:
            err_console.print(f"[bold red]error: [/]{escape(problem)}", soft_wrap=True)
        fail(
            problems[-1],
            hint=f"nothing was started; `elixir-run {plan_path} {name} --help` lists the options",
            code=EXIT_USAGE,
        )
    return [*torchrun_options, "-m"], module


def _refuse_unknown_options(torchrun_options: list[str], arity: dict[str, bool]) -> None:
    """An option before PLAN that is neither elixir-run's nor torchrun's is a typo: one line with the closest
    option, before torchrun would print its whole usage after the workers' start."""
    import difflib

    unknown = [option_name(token) for token in torchrun_options if token.startswith("-")]
    unknown = [name for name in unknown if name not in arity]
    if not unknown:
        return
    own = [name for param in click.get_current_context().command.params for name in param.opts]
    if unknown[0] in own:
        fail(
            f"elixir-run's own {unknown[0]} comes after a torchrun option: put elixir-run's options first",
            hint="usage: elixir-run [OPTIONS] [TORCHRUN_OPTIONS] PLAN SCRIPT [SCRIPT_ARGS]...",
            code=EXIT_USAGE,
        )
    close = difflib.get_close_matches(unknown[0], own + list(arity), n=1)
    fail(
        f"no such option: {unknown[0]}" + (f" (did you mean {close[0]}?)" if close else ""),
        hint="elixir-run's options and torchrun's go before PLAN, the script's after SCRIPT; see elixir-run --help",
        code=EXIT_USAGE,
    )


def say(text: str) -> None:
    """One progress line from elixir-run itself (stderr: unbuffered, apart from the workers' output)."""
    err_console.print(f"elixir-run: {text}", markup=False, soft_wrap=True)


def _launch(spec: LaunchSpec, env: dict[str, str], plan, rdzv_timeout_s: float, collective_timeout_s: float) -> None:
    """Meets the other nodes, runs torchrun with the watch over the workers, and exits with the job's status."""
    roll = None
    if spec.nnodes > 1 or spec.rdzv_endpoint:
        say(f"joining the rendezvous at {spec.rdzv_endpoint} as node {spec.node_rank} of {spec.nnodes}")
        try:
            # Kept until the job ends: on node 0 it serves the store that torchrun's agent shares.
            roll = roll_call(str(spec.rdzv_endpoint), spec.rdzv_id, spec.nnodes, spec.node_rank, rdzv_timeout_s, say)
        except RendezvousWaitError as error:
            fail(str(error), hint=error.hint)
        roll.start_heartbeat(spec.rdzv_id, spec.node_rank)  # the others name this node if it is lost
    run_dir = Path(tempfile.mkdtemp(prefix="elixir-run-"))
    env = {**env, **bootstrap_env(run_dir)}
    os.environ.update(env)
    say(f"starting {spec.nproc_per_node} worker(s) on this node")
    sys.stdout.flush()
    watch = WorkerWatch(run_dir, collective_timeout_s, say).start()
    _quiet_torchrun_warnings()
    try:
        outcome = run_torchrun(spec, watch)
        lost = roll.lost_nodes(spec.rdzv_id, spec.nnodes, spec.node_rank) if roll and outcome.exit_code else []
        if lost:
            outcome = lost_node_outcome(outcome, lost)
    finally:
        watch.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        if roll is not None:
            roll.stop_heartbeat(spec.rdzv_id, spec.node_rank)
        del roll
    if outcome.exit_code:
        fail(outcome.message, hint=outcome.hint, code=outcome.exit_code)
    console.print(f"[green]elixir-run: job finished[/] ({plan.world_size} worker(s))")


def _quiet_torchrun_warnings() -> None:
    """torchrun's agent logs a warning line per worker on Ctrl-C ("Sending process N closing signal SIGINT"):
    elixir-run says what happened itself, so only torchrun's errors pass (unless $LOGLEVEL asks otherwise)."""
    import logging

    import torch.distributed.run  # noqa: F401  (creates the elastic loggers, each at $LOGLEVEL or WARNING)

    if "LOGLEVEL" in os.environ:
        return
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)


def _print_summary(plan, plan_path: str, checks, nnodes: int, node_rank: int) -> None:
    cluster, training = plan.cluster, plan.training
    model = plan.model.name or plan.model.source
    console.print(
        f"[bold]elixir-run[/] {escape(plan_path)}: {escape(model)} ({plan.model.num_params:,} params), "
        f"{cluster.nodes} node(s) x {cluster.gpus_per_node} {cluster.device} worker(s) ({cluster.backend}), "
        f"micro-batch {training.micro_batch_size} x accumulation {training.grad_accum_steps} x "
        f"world {plan.world_size} = global batch {training.global_batch_size}, {training.dtype}"
        + (f"; node {node_rank} of {nnodes}" if nnodes > 1 else ""),
        soft_wrap=True,
    )
    if plan.prediction is not None:  # the run ends with the measured figures beside these
        console.print(
            f"  predicted for {escape(cluster.hardware)}: {plan.prediction.step_time_s * 1000:,.1f} ms/step, peak "
            f"{plan.rank_memory(0).peak_gpu_bytes / 2**30:.2f} GiB per worker",
            soft_wrap=True,
        )
    for check in checks:
        mark = _MARK[check.ok] if check.ok or check.fatal else "[yellow]warn[/]"
        (console if check.ok or not check.fatal else err_console).print(
            f"  {mark} {check.name}: {escape(check.detail)}", soft_wrap=True
        )


def main() -> None:
    run_command(prog_name="elixir-run")


if __name__ == "__main__":
    main()
