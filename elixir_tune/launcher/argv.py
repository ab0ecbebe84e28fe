"""torchrun command lines: what elixir-run passes to `torch.distributed.run`.

Pure functions over plain values, so the exact command is testable without starting anything.
elixir-run owns the options that decide the world (processes per node, nodes, rendezvous,
restarts); every other torchrun option the user gives is passed through unchanged.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# torchrun options that elixir-run sets from the plan or from its own flags. Passing them
# through as well would give torchrun two conflicting values.
MANAGED_OPTIONS = frozenset(
    {
        "--nproc-per-node",
        "--nproc_per_node",
        "--nnodes",
        "--node-rank",
        "--node_rank",
        "--rdzv-backend",
        "--rdzv_backend",
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        "--rdzv-id",
        "--rdzv_id",
        "--standalone",
        "--max-restarts",
        "--max_restarts",
        "--master-addr",
        "--master_addr",
        "--master-port",
        "--master_port",
    }
)

# torchrun options after which SCRIPT is not a file path (a module name or an executable).
NOT_A_FILE_OPTIONS = frozenset({"-m", "--module", "--no-python", "--no_python"})


class ArgvError(ValueError):
    """The command line cannot be split into torchrun options, PLAN, SCRIPT and script arguments."""


@dataclass
class LaunchSpec:
    """Everything that decides the torchrun command line.

    Attributes:
        nproc_per_node: worker processes on this node (the plan's gpus_per_node).
        script: the training script (or module name, with ``-m`` in ``torchrun_options``).
        script_args: arguments for the script, passed unchanged.
        nnodes: number of nodes taking part.
        node_rank: this node's rank, 0-based.
        rdzv_endpoint: HOST:PORT of the c10d rendezvous; None on one node uses a private one.
        rdzv_id: job id shared by all nodes of one job.
        max_restarts: how often torchrun restarts the worker group after a failure.
        torchrun_options: other torchrun options, passed through before the script.
        bootstrap: start each worker through ``elixir_tune.launcher.worker_main``, which ties its
            life to this process, then runs the script (not with ``--no-python``).
        rdzv_timeout_s: how long the c10d rendezvous waits for every node (torchrun's
            ``join_timeout``) unless the user's ``--rdzv-conf`` sets one; None: torchrun's default.
    """

    nproc_per_node: int
    script: str
    script_args: Sequence[str] = ()
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str = "elixir-tune"
    max_restarts: int = 0
    torchrun_options: Sequence[str] = field(default_factory=tuple)
    bootstrap: bool = False
    rdzv_timeout_s: float | None = None


def compose_torchrun_argv(spec: LaunchSpec) -> list[str]:
    """The arguments for `torch.distributed.run` (what follows `torchrun` on a command line).

    One node without an endpoint uses ``--standalone`` (a c10d rendezvous on a free local
    port); otherwise a c10d rendezvous at the endpoint, which every node names the same way,
    where the agent on the endpoint's host serves the store and assigns the global ranks.

    Args:
        spec: the launch.

    Returns:
        torchrun's argv, without the program name.
    """
    argv = [f"--nproc-per-node={spec.nproc_per_node}"]
    options = list(spec.torchrun_options)
    if spec.nnodes == 1 and not spec.rdzv_endpoint:
        argv.append("--standalone")
    else:
        # No --node-rank: with c10d torchrun assigns ranks at the rendezvous and warns that it
        # ignores one; elixir-run still checks the user's node rank against --nnodes.
        argv += [
            f"--nnodes={spec.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
            f"--rdzv-id={spec.rdzv_id}",
        ]
        if spec.rdzv_timeout_s is not None:
            options = _with_join_timeout(options, spec.rdzv_timeout_s)
    argv.append(f"--max-restarts={spec.max_restarts}")
    script, script_args = spec.script, list(spec.script_args)
    if spec.bootstrap and not any(option_name(token) in ("--no-python", "--no_python") for token in options):
        module_flags = [token for token in options if token in ("-m", "--module")]
        options = [token for token in options if token not in module_flags]
        script_args = (["-m"] if module_flags else []) + [script, *script_args]
        script = WORKER_MAIN
        options.append("-m")
    argv += options
    argv.append(script)
    argv += script_args
    return argv


WORKER_MAIN = "elixir_tune.launcher.worker_main"


def _with_join_timeout(options: list[str], timeout_s: float) -> list[str]:
    """Adds ``join_timeout`` to torchrun's --rdzv-conf (a new one, or the user's) unless the user set it."""
    setting = f"join_timeout={timeout_s:g}"
    result = list(options)
    for index, token in enumerate(result):
        name = option_name(token)
        if name not in ("--rdzv-conf", "--rdzv_conf"):
            continue
        inline = "=" in token
        value = token.split("=", 1)[1] if inline else (result[index + 1] if index + 1 < len(result) else "")
        if "join_timeout" in value:
            return result
        merged = f"{value},{setting}" if value else setting
        if inline:
            result[index] = f"{name}={merged}"
        else:
            result[index + 1] = merged
        return result
    return [*result, f"--rdzv-conf={setting}"]


def format_command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """A shell command line that reproduces the launch: ``VAR=value ... torchrun ARGV``."""
    prefix = [f"{name}={shlex.quote(value)}" for name, value in (env or {}).items()]
    return " ".join(prefix + ["torchrun", shlex.join(argv)])


def option_name(token: str) -> str:
    """``--name=value`` -> ``--name``; other tokens unchanged."""
    return token.split("=", 1)[0] if token.startswith("--") else token


def split_command_line(tokens: Sequence[str], takes_value: Mapping[str, bool]) -> tuple[list[str], str, str, list[str]]:
    """Splits ``[TORCHRUN_OPTIONS...] PLAN SCRIPT [--] [SCRIPT_ARGS...]``.

    Args:
        tokens: what follows elixir-run's own options.
        takes_value: for each torchrun option name, whether it reads the next token as its value
            (ignored for ``--name=value``). Unknown options are passed through as flags.

    Returns:
        (torchrun options, PLAN, SCRIPT, script arguments).

    Raises:
        ArgvError: PLAN or SCRIPT is missing, or an option elixir-run manages is passed through.
    """
    tokens = list(tokens)
    options: list[str] = []
    index = 0
    while index < len(tokens) and tokens[index].startswith("-") and tokens[index] != "--":
        token = tokens[index]
        name = option_name(token)
        if name in MANAGED_OPTIONS:
            own = name.replace("_", "-")
            raise ArgvError(
                f"{name} is set by elixir-run from the plan or its own options"
                + (
                    f" (use elixir-run's {own} before other torchrun options)"
                    if own in ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--max-restarts")
                    else ""
                )
            )
        options.append(token)
        index += 1
        if "=" not in token and takes_value.get(name, False):
            if index >= len(tokens):
                raise ArgvError(f"torchrun option {name} needs a value")
            options.append(tokens[index])
            index += 1
    if index < len(tokens) and tokens[index] == "--":
        index += 1
    rest = tokens[index:]
    if not rest:
        raise ArgvError("missing PLAN (the plan file written by `elixir-tune search`)")
    if len(rest) < 2:
        raise ArgvError("missing SCRIPT (the training script to run on every worker)")
    script_args = rest[2:]
    # `elixir-run plan.yaml train.py -- --steps 10` (the form of docs/overview.md, commands) means the same as without `--`.
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    return options, rest[0], rest[1], script_args


def script_is_a_file(torchrun_options: Sequence[str]) -> bool:
    """Whether SCRIPT names a file (not a module with -m, nor an executable with --no-python)."""
    return not any(option_name(token) in NOT_A_FILE_OPTIONS for token in torchrun_options)


def torchrun_option_arity() -> dict[str, bool]:
    """For each option of this torch's torchrun, whether it takes a value.

    Read from torchrun's own argument parser so that a new torch's options pass through too.
    """
    from torch.distributed.run import get_args_parser

    arity: dict[str, bool] = {}
    for action in get_args_parser()._actions:  # argparse keeps no public list of actions
        for name in action.option_strings:
            arity[name] = action.nargs != 0
    return arity
