"""What every recipe shares before training: its command-line options, the run's plan and device, and the model.

The options are parsed twice: by elixir-run's preflight (``parse_options(..., for_preflight=True)``, where a bad
option is a problem line, not an exit) and by each worker.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import NoReturn

from elixir_tune.recipes import BUNDLED_TEXT
from elixir_tune.recipes.suggest import did_you_mean


class OptionsError(ValueError):
    """A recipe's command line does not parse (the message is argparse's)."""


class RecipeParser(argparse.ArgumentParser):
    """argparse, except that in a preflight a bad option raises OptionsError instead of printing usage and exiting."""

    raise_errors = False

    def __init__(self, *args, **kwargs):
        # argparse takes --epoch 1 as --epochs 1 and --step 3 as --steps 3: a full run from a typo.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        message += did_you_mean(message, list(self._option_string_actions))  # argparse keeps no public list
        if self.raise_errors:
            raise OptionsError(message)
        super().error(message)


def add_training_args(parser: argparse.ArgumentParser, lr: float = 3e-3) -> None:
    """The options every recipe takes: its settings file, length, schedule, evaluation, logging, checkpoints."""
    from elixir_tune.recipes.settings_file import CONFIG_HELP

    parser.add_argument("--config", default=None, metavar="FILE", help=CONFIG_HELP)
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 100)")
    length.add_argument(
        "--epochs",
        type=float,
        default=None,
        help="passes over the training samples instead of --steps (steps = epochs x samples / global batch)",
    )
    parser.add_argument("--log", default="runs/train.json", help="JSON log of every step (rank 0)")
    parser.add_argument("--lr", type=float, default=lr, help="peak learning rate (AdamW)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up (default: steps / 10)")
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights (same on every rank) and the data")
    parser.add_argument("--print-every", type=int, default=None, help="print a line every N steps (default: ~20 lines)")
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="evaluation loss and perplexity on the held-out split every N steps and at the end (0: at the end only)",
    )
    parser.add_argument(
        "--eval-fraction", type=float, default=0.0, metavar="F", help="hold out this share of the samples for eval"
    )
    parser.add_argument("--eval-data", default=None, metavar="FILE", help="a separate evaluation file")
    parser.add_argument(
        "--keep-best",
        action="store_true",
        help="with --save: also save at each evaluation that beats the best so far (DIR/best names it)",
    )
    parser.add_argument("--log-dir", default=None, metavar="DIR", help="write TensorBoard event files here")
    parser.add_argument(
        "--wandb", default=None, metavar="PROJECT", help="log to this Weights & Biases project (needs wandb)"
    )
    parser.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="checkpoint directory: saved at the end, every --save-every steps and on SIGINT/SIGTERM",
    )
    parser.add_argument("--save-every", type=int, default=0, metavar="N", help="also save every N steps (0: never)")
    parser.add_argument(
        "--keep",
        type=int,
        default=2,
        metavar="N",
        help="keep the newest N checkpoints in --save (DIR/step-NNNNNN, DIR/latest names the newest; 0: all)",
    )
    parser.add_argument(
        "--resume", default=None, metavar="DIR", help="continue from this checkpoint (a --save DIR: its latest)"
    )
    parser.add_argument(
        "--new-data",
        action="store_true",
        help="with --resume: go on with other data than the checkpoint was saved with (refused otherwise)",
    )
    parser.add_argument(
        "--stop-at",
        type=int,
        default=None,
        metavar="N",
        help="stop after N steps, keeping the --steps schedule (as an interrupted run would)",
    )


def parse_options(parser: RecipeParser, argv: list[str], for_preflight: bool = False) -> argparse.Namespace:
    """Parses a recipe's arguments and checks the ones that need no file.

    ``--config FILE`` and ``KEY=VALUE`` arguments set options too (settings_file.py): the file < the overrides <
    the ``--flags``.

    Args:
        parser: the recipe's parser.
        argv: its arguments.
        for_preflight: raise OptionsError for a bad option instead of exiting with argparse's usage.

    Returns:
        The options.

    Raises:
        OptionsError: (with ``for_preflight``) an option is unknown, malformed or out of range, or the settings
            file or an override does not fit the options.
    """
    from elixir_tune.recipes.settings_file import SettingsError, apply_settings, split_overrides

    parser.raise_errors = for_preflight
    flags, overrides = split_overrides(parser, argv)
    args = parser.parse_args(flags)
    try:
        apply_settings(parser, args, flags, overrides)
    except SettingsError as error:
        parser.error(str(error))
    problems = option_problems(args)
    if problems:
        parser.error(problems[0])
    return args


def option_problems(args: argparse.Namespace) -> list[str]:
    """Values that are out of range (each a line saying which and what is accepted)."""
    problems = []
    for name in ("steps", "eval_every", "save_every", "keep"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "steps" else 0):
            problems.append(
                f"--{name.replace('_', '-')} must be {'1' if name == 'steps' else '0'} or more, not {value}"
            )
    if args.epochs is not None and args.epochs <= 0:
        problems.append(f"--epochs must be above 0, not {args.epochs:g}")
    problems += number_problems(args)
    if not 0.0 <= args.eval_fraction < 1.0:
        problems.append(f"--eval-fraction is a share of the samples, 0 <= F < 1, not {args.eval_fraction:g}")
    if args.eval_fraction and args.eval_data:
        problems.append("give --eval-fraction or --eval-data, not both")
    if args.new_data and not args.resume:
        problems.append("--new-data allows other data on a --resume: add --resume DIR, or drop it")
    if args.keep_best and not args.save:
        problems.append("--keep-best keeps the best checkpoint under --save DIR: add --save")
    return problems


def number_problems(args: argparse.Namespace) -> list[str]:
    """The schedule's numbers that parse but cannot mean what was asked (NaN, negative, a stop before the start).

    Args:
        args: the recipe's parsed options.

    Returns:
        One line per bad value, naming the option, the value and what it accepts.
    """
    problems = []
    lr = args.lr
    if not math.isfinite(lr) or lr <= 0:
        problems.append(f"--lr must be a finite number above 0 (e.g. --lr 3e-4), not {lr:g}")
    if not math.isfinite(args.clip) or args.clip < 0:
        problems.append(
            f"--clip is the largest gradient norm kept, a finite number >= 0 (0: no clipping), not {args.clip:g}"
        )
    for name, least in (("warmup_steps", 0), ("stop_at", 1), ("print_every", 1)):
        value = getattr(args, name, None)
        if value is not None and value < least:
            problems.append(f"--{name.replace('_', '-')} must be {least} or more, not {value}")
    if args.epochs is not None and not math.isfinite(args.epochs):
        problems.append(f"--epochs must be a finite number above 0, not {args.epochs:g}")
    return problems


def plan_and_device():
    """The plan elixir-run gave this worker ($ELIXIR_TUNE_PLAN), its path, and the device it runs on
    (the GPU of LOCAL_RANK for a cuda plan, made current; the CPU otherwise)."""
    import torch

    import elixir_tune
    from elixir_tune.device import ops_for

    plan_path = os.environ.get(elixir_tune.plan.PLAN_ENV_VAR, "")
    plan = elixir_tune.load_plan()
    if plan.cluster.device != "cuda":
        return plan_path, plan, torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    ops_for(device).set_device()
    return plan_path, plan, device


def bundled_data_note(args: argparse.Namespace) -> str | None:
    """The line a run on the bundled demo text prints at its start, or None when the data is the user's.

    Without ``--data`` a recipe trains on the public-domain text it ships; the run must say so, or a user who
    forgot ``--data`` would fine-tune on it unawares.
    """
    if getattr(args, "synthetic", False) or Path(args.data).resolve() != BUNDLED_TEXT:
        return None
    return f"data: the bundled demo text ({BUNDLED_TEXT.name}); give --data FILE for yours"


def resolve_model_spec(spec: str, plan_path: str) -> str:
    """A relative model path is tried from the working directory, then beside the plan."""
    path_part = spec.split(":")[0]
    if not Path(path_part).exists():
        beside_plan = Path(plan_path).resolve().parent / path_part
        if beside_plan.exists():
            return str(beside_plan) + spec[len(path_part) :]
    return spec


def resolve_model_dir(spec: str, plan_path: str) -> Path:
    """A Hugging Face model: a directory (from here or beside the plan) or a Hub name in the local cache.

    Args:
        spec: ``--model`` or the plan's ``model.source``.
        plan_path: the plan file, for paths relative to it.

    Returns:
        The directory (it has a config.json).

    Raises:
        ValueError: neither a model directory nor a cached name (one line: what and where it looked).
    """
    from elixir_tune.hf_cache import cached_model_dir, looks_like_hub_name

    resolved = Path(resolve_model_spec(spec, plan_path))
    if resolved.is_dir():
        if not (resolved / "config.json").is_file():
            raise ValueError(f"--model {spec}: not a model directory (no config.json); give a Hugging Face model dir")
        return resolved
    if looks_like_hub_name(spec):
        return cached_model_dir(spec)
    raise ValueError(
        f"--model {spec}: no such directory (looked in {Path.cwd()} and beside the plan); give a Hugging Face "
        "model directory or a Hub name (owner/name) in the local cache"
    )


# Where a recipe writes: option -> whether it names a directory (True) or a file (False).
OUTPUT_OPTIONS = {"--log": False, "--log-dir": True, "--save": True, "--save-pretrained": True}


def output_problems(args: argparse.Namespace) -> list[str]:
    """The places the run will write that cannot be written, found before any worker starts: one line each.

    A save or log that fails hours into a run loses that run's end; these are the failures a look at the
    paths can show now (the same failures later are shared by every rank: engine/io, recipes/loop.py).

    Args:
        args: the recipe's parsed options (those of ``OUTPUT_OPTIONS`` it has).

    Returns:
        One line per option naming it, its value and what is in the way.
    """
    problems = []
    for option, is_directory in OUTPUT_OPTIONS.items():
        value = getattr(args, option.removeprefix("--").replace("-", "_"), None)
        if not value:
            continue
        path = Path(value)
        if is_directory and path.exists() and not path.is_dir():
            problems.append(f"{option} {value}: a file is there, where the run writes a directory; give another path")
            continue
        if not is_directory and path.is_dir():
            problems.append(f"{option} {value}: is a directory; give a file name")
            continue
        ancestor = path.absolute().parent
        while not ancestor.exists():  # the nearest existing parent: the run creates the rest
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            problems.append(f"{option} {value}: {ancestor} is a file, not a directory; give another path")
        elif not os.access(ancestor, os.W_OK | os.X_OK):
            problems.append(f"{option} {value}: {ancestor} is not writable by this user")
    return problems
