"""The launcher: torchrun argv composition, plan/machine checks, worker environment, the job.

`elixir-run` (cli/run.py) is the user's entry; these functions are what it is built from.
Only `launch` and `observe_machine` import torch, when called.
"""

from elixir_tune.launcher.argv import (
    MANAGED_OPTIONS,
    ArgvError,
    LaunchSpec,
    compose_torchrun_argv,
    format_command,
    script_is_a_file,
    split_command_line,
    torchrun_option_arity,
)
from elixir_tune.launcher.checks import Check, MachineFacts, check_launch, failed, observe_machine, parse_endpoint
from elixir_tune.launcher.env import worker_env
from elixir_tune.launcher.launch import LaunchOutcome, WorkerFailure, describe_failures, run_torchrun
from elixir_tune.launcher.slurm import SlurmAllocation, SlurmError, first_host, read_allocation

__all__ = [
    "MANAGED_OPTIONS",
    "ArgvError",
    "LaunchSpec",
    "compose_torchrun_argv",
    "format_command",
    "script_is_a_file",
    "split_command_line",
    "torchrun_option_arity",
    "Check",
    "MachineFacts",
    "check_launch",
    "failed",
    "observe_machine",
    "parse_endpoint",
    "worker_env",
    "LaunchOutcome",
    "WorkerFailure",
    "describe_failures",
    "run_torchrun",
    "SlurmAllocation",
    "SlurmError",
    "first_host",
    "read_allocation",
]
