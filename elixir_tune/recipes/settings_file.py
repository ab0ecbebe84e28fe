"""A recipe's settings file: ``--config run.yaml``, ``KEY=VALUE`` overrides, and the file a run writes back.

    elixir-run plan.yaml finetune --config run.yaml lr=3e-4 --steps 50

``run.yaml`` is a mapping of the recipe's options by name (``steps: 200``, ``lr: 3e-4``, ``data: chats.jsonl``,
``save_pretrained: out``; ``save-pretrained`` is read as well), each value checked by the option's own type, as
torchtune's and TRL's YAML files are. A ``KEY=VALUE`` argument (no leading ``--``) overrides the file, and a
``--flag`` overrides both. Paths are from the working directory, as on the command line. Each run writes every
option's final value back (``write_settings``: into ``--save`` and ``--save-pretrained``, else beside ``--log``),
so ``--config`` of that file repeats the run. No torch here: elixir-run's preflight parses the same way.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from elixir_tune.recipes.export_dir import SETTINGS_NAME

CONFIG_HELP = (
    "a YAML file of this recipe's options by name (steps: 200, lr: 3e-4, data: chats.jsonl); KEY=VALUE arguments "
    "override it and --flags override both. Every run writes its settings back (DIR/" + SETTINGS_NAME + " in --save "
    "and --save-pretrained, else beside --log: runs/train.settings.yaml): --config of that file repeats the run"
)
# What a typed option's value must be, for messages.
TYPE_WORDS = {"int": "a whole number", "float": "a number"}


class SettingsError(ValueError):
    """A settings file or override that does not fit the recipe's options (one line)."""


def split_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """Separates the ``KEY=VALUE`` overrides from the arguments argparse parses.

    A token is an override when it has no leading ``-``, holds ``=`` and is no option's value (``--data a=b.txt``
    stays the data file's name).

    Args:
        parser: the recipe's parser.
        argv: its arguments.

    Returns:
        (the arguments for argparse, the overrides in their order).
    """
    flags: list[str] = []
    overrides: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            flags += [token, *tokens]
            break
        if token.startswith("-"):
            flags.append(token)
            action = parser._option_string_actions.get(token)  # argparse keeps no public table
            if action is not None and action.nargs != 0:  # its value follows: never an override
                flags += [value for value in [next(tokens, None)] if value is not None]
        elif "=" in token:
            overrides.append(token)
        else:
            flags.append(token)  # argparse refuses it, naming it
    return flags, overrides


def apply_settings(parser: argparse.ArgumentParser, args: argparse.Namespace, flags: list[str], overrides: list[str]):
    """Sets the options the file (``args.config``) and the overrides give, where no ``--flag`` gave them.

    Precedence: the file < the overrides < the flags. Of options that exclude each other (``--steps`` and
    ``--epochs``) the one given at the highest level stays and the others are unset.

    Args:
        parser: the recipe's parser.
        args: the options argparse parsed from ``flags`` (changed in place).
        flags: the arguments argparse parsed, for the options given explicitly.
        overrides: the ``KEY=VALUE`` arguments.

    Raises:
        SettingsError: the file does not read, or a key is no option, or a value does not fit its option.
    """
    actions = {action.dest: action for action in parser._actions if action.option_strings}
    actions = {dest: action for dest, action in actions.items() if dest not in ("help", "config")}
    given = {
        parser._option_string_actions[name].dest
        for name in (token.split("=", 1)[0] for token in flags)
        if name in parser._option_string_actions
    }
    chosen: dict[str, Any] = {}
    for layer in _layers(parser, actions, args.config, overrides):
        typed = {dest: _typed(actions[dest], *entry) for dest, entry in layer.items()}
        for dest, value in typed.items():
            partners = _exclusive_partners(parser, dest)
            clash = [other for other in partners if typed.get(other) is not None]
            if value is not None and clash:
                where = "the KEY=VALUE arguments" if layer[dest][2] else layer[dest][3]
                raise SettingsError(f"{where}: {dest} and {clash[0]} exclude each other: give one of them")
            if dest in given:
                continue
            if value is not None:
                chosen.update({other: None for other in partners if other not in given})
            chosen[dest] = value
    for dest in given:  # a flag unsets what a lower level gave of its exclusive partners
        if getattr(args, dest, None) is not None:
            chosen.update({other: None for other in _exclusive_partners(parser, dest)})
    for dest, value in chosen.items():
        setattr(args, dest, value)


def _layers(parser: argparse.ArgumentParser, actions: dict, config: str | None, overrides: list[str]) -> list[dict]:
    """The file's and the overrides' settings, lowest first: option -> (key, value, from_text, source)."""
    from elixir_tune.files import InputFileError, load_yaml_mapping

    layers = []
    if config:
        try:
            raw = load_yaml_mapping(config, "settings", "a mapping of the recipe's options, e.g. steps: 200")
        except InputFileError as error:
            raise SettingsError(f"--config {error}") from None
        where = f"--config {config}"
        layers.append(
            {_dest(parser, actions, key, f"{where}: {key!r}"): (key, value, False, where) for key, value in raw.items()}
        )
    split = [(token, *token.split("=", 1)) for token in overrides]
    layers.append({_dest(parser, actions, key, token): (key, text, True, token) for token, key, text in split})
    return layers


def _dest(parser: argparse.ArgumentParser, actions: dict, key: Any, where: str) -> str:
    """The option a key names (``save_pretrained`` or ``save-pretrained``); refused, with the closest, if none."""
    from elixir_tune.recipes.suggest import did_you_mean

    dest = str(key).strip().replace("-", "_")
    if dest in actions:
        return dest
    dashed = "--" + str(key).strip().lstrip("-").replace("_", "-")
    close = did_you_mean(f"unrecognized arguments: {dashed}", list(parser._option_string_actions))
    raise SettingsError(f"{where}: no option of this recipe has that name{close}; `{parser.prog} --help` lists them")


def _typed(action: argparse.Action, key: str, value: Any, from_text: bool, source: str) -> Any:
    """``value`` as the option's type makes it (an override's text is read as a YAML scalar first)."""
    import yaml

    option = action.option_strings[-1]
    if from_text and (action.nargs == 0 or action.type is not None or value in ("", "null", "~")):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            pass  # a text: the option's type judges it
    where = f"{source}: {key}" if not from_text else source
    if action.nargs == 0:  # a switch (--packing): true or false
        if not isinstance(value, bool):
            raise SettingsError(f"{where}: {option} is a switch: give true or false, not {value!r}")
        return value
    if value is None:
        if action.default is not None:
            raise SettingsError(f"{where}: {option} needs a value (default {action.default}); give one or drop it")
        return None
    if isinstance(value, (dict, list)):
        raise SettingsError(f"{where}: {option} takes one value, not {value!r}")
    if isinstance(value, bool):  # YAML reads yes, no, on and off as true and false
        raise SettingsError(f"{where}: {option} takes a value, not {value!r}: quote a text ('yes')")
    text = value if isinstance(value, str) else str(value)
    try:
        typed = action.type(text) if callable(action.type) else text
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        kind = TYPE_WORDS.get(getattr(action.type, "__name__", ""), "a valid value")
        raise SettingsError(f"{where}: {option} must be {kind}, not {value!r}") from None
    if action.choices is not None and typed not in action.choices:
        raise SettingsError(f"{where}: {option} must be one of {', '.join(map(str, action.choices))}, not {typed!r}")
    return typed


def _exclusive_partners(parser: argparse.ArgumentParser, dest: str) -> list[str]:
    """The options that exclude ``dest`` (argparse's mutually exclusive groups)."""
    for group in parser._mutually_exclusive_groups:
        dests = [action.dest for action in group._group_actions]
        if dest in dests:
            return [other for other in dests if other != dest]
    return []


def settings_paths(args: argparse.Namespace) -> list[Path]:
    """Where a run writes its settings: ``SETTINGS_NAME`` in --save and --save-pretrained, else beside --log
    (``runs/train.json`` -> ``runs/train.settings.yaml``); none when the run writes none of these."""
    from elixir_tune.recipes.export_dir import export_dir_problem

    export = getattr(args, "save_pretrained", None)
    # A directory of the user's files is refused for the export: nothing of the run goes there either.
    directories = [value for value in (args.save, export) if value and not export_dir_problem(value)]
    if directories:
        return [Path(directory) / SETTINGS_NAME for directory in directories]
    if args.save or export or not args.log:
        return []
    return [Path(args.log).with_suffix(".settings.yaml")]


def settings_text(args: argparse.Namespace, recipe: str) -> str:
    """Every option's value as a YAML settings file, which ``--config`` reads back to the same options."""
    import yaml

    values = {
        dest: value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
        for dest, value in vars(args).items()
        if dest != "config"
    }
    return (
        f"# The settings of an elixir-tune {recipe} run: `elixir-run PLAN {recipe} --config THIS_FILE` repeats it.\n"
        + yaml.safe_dump(values, sort_keys=False)
    )


def write_settings(args: argparse.Namespace, recipe: str, rank: int) -> None:
    """Rank 0 writes the run's settings (``settings_paths``) before it trains, so an interrupted run can be
    repeated as well; a failure is a warning, since the run's logs and checkpoints report their own."""
    if rank != 0:
        return
    text = settings_text(args, recipe)
    for path in settings_paths(args):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as error:
            print(f"warning: could not write the run's settings to {path}: {error.strerror or error}", flush=True)
