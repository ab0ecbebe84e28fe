"""The training programs that ship with elixir-tune, run by name: ``elixir-run plan.yaml finetune ...``.

    finetune   fine-tune a Hugging Face model (a directory or a cached Hub name) on your data, fully or with LoRA
               (finetune.py; its data and LoRA options: finetune_options.py)
    pretrain   train a model from its initializer on text bytes or random tokens (pretrain.py)

elixir-run reads a bare SCRIPT (no ``/``, no ``.py``) as a recipe name: it runs the recipe's module on every
worker (``python -m elixir_tune.recipes.NAME``), after the recipe's ``preflight`` has checked the inputs in
elixir-run's own process. A path is still the user's own script. The shared parts: options.py (the command-line
options and the run's plan, device and model), text_data.py (pretrain's byte and random samplers), data_identity.py
(the data a checkpoint records, and the refusal of a resume on other data), loop.py (the steps),
evaluation.py (eval loss over a split), progress.py (the bar, the printed lines and the JSON log),
throughput.py (the tokens a step learned from, padding apart; the plan's prediction against the run) and
metrics.py (TensorBoard, Weights & Biases). Imports nothing heavy itself: a recipe's module imports torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path

RECIPES = {
    "finetune": "fine-tune a Hugging Face model (directory or cached name) on your data",
    "pretrain": "train a model from scratch on text bytes or random tokens",
}

# The public-domain text the recipes train on when no --data is given (shipped as package data).
BUNDLED_TEXT = Path(__file__).resolve().parent / "public_domain.txt"


class UnknownRecipeError(ValueError):
    """A bare SCRIPT name that is no recipe (the message lists the recipes)."""


def is_recipe_name(script: str) -> bool:
    """Whether elixir-run's SCRIPT is a recipe name rather than a path: no ``/`` and no ``.py``.

    Args:
        script: SCRIPT as the user typed it.

    Returns:
        True for a bare name such as ``finetune``.
    """
    return "/" not in script and "\\" not in script and not script.endswith(".py")


def recipe_module(name: str) -> str:
    """The module a recipe name runs.

    Args:
        name: a recipe name, e.g. ``finetune``.

    Returns:
        ``elixir_tune.recipes.NAME``.

    Raises:
        UnknownRecipeError: not a recipe (the message lists them).
    """
    if name not in RECIPES:
        import difflib

        known = "; ".join(f"{recipe} ({what})" for recipe, what in RECIPES.items())
        close = difflib.get_close_matches(name, list(RECIPES), n=1)
        raise UnknownRecipeError(
            f"{name!r} is neither a recipe nor a file"
            + (f" (did you mean {close[0]}?)" if close else "")
            + f": the recipes are {known}; a script of your own is a path (./train.py)"
        )
    return f"{__name__}.{name}"


def preflight(name: str, argv: list[str], plan_path: str) -> list[str]:
    """The recipe's own input checks, run by elixir-run before any worker starts.

    Args:
        name: the recipe name.
        argv: the arguments the recipe will get.
        plan_path: the plan file the job runs.

    Returns:
        One line per problem found (empty when the inputs look right).

    Raises:
        UnknownRecipeError: not a recipe.
    """
    module = importlib.import_module(recipe_module(name))
    return list(module.preflight(argv, plan_path))
