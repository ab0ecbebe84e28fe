"""What ``elixir-run PLAN`` runs for a profiled model: a recipe's command, or the user's own script."""

from __future__ import annotations

import shlex
from pathlib import Path

from elixir_tune.hf_cache import looks_like_hub_name

# What the pretrain recipe hands the model: the forward must take these (and may take the optional ones).
PRETRAIN_INPUTS = {"input_ids", "labels"}
OPTIONAL_INPUTS = {"attention_mask", "position_ids"}
BYTE_VOCAB = 256  # pretrain's text tokens are bytes


def run_script_for(profile, data: str = "FILE") -> tuple[str, str]:
    """What ``elixir-run PLAN`` runs for the profiled model: SCRIPT and its arguments, and why when it is not
    a recipe's plain command (``pretrain_command``).

    A Hugging Face model (a directory or a cached Hub name) is fine-tuned from its weights; other models train
    from scratch. Recipe names work from any directory, so the model path is made absolute.

    Args:
        profile: the model's profile.
        data: what ``--data`` names for a fine-tune.

    Returns:
        (SCRIPT and its arguments, a note or "").
    """
    source_dir = Path(str(profile.source))
    if source_dir.is_dir() and (source_dir / "config.json").is_file():
        script = f"finetune --model {shlex.quote(str(source_dir.resolve()))} --data {data}"
    elif looks_like_hub_name(str(profile.source)):
        script = f"finetune --model {shlex.quote(str(profile.source))} --data {data}"
    else:
        return pretrain_command(profile)
    if profile.lora:  # the plan carries them; printed so that the command says what it trains
        from elixir_tune.recipes.finetune_options import lora_flags

        script += " " + lora_flags(profile.lora)
    return script, ""


def pretrain_command(profile) -> tuple[str, str]:
    """What runs a model trained from scratch: the pretrain recipe when the model takes what it feeds
    (input_ids and labels; bytes of text need a vocabulary of 256), else the user's own script.

    Returns:
        (SCRIPT and its arguments for ``elixir-run PLAN``, a note on why it is not the recipe, or "").
    """
    inputs = set(profile.inputs)
    if inputs and not (PRETRAIN_INPUTS <= inputs <= PRETRAIN_INPUTS | OPTIONAL_INPUTS):
        return "train.py", (
            f"your own training script: the model takes {', '.join(profile.inputs)}, and the pretrain recipe feeds "
            "input_ids and labels only; elixir_tune.setup(model, optimizer) in the script reads the plan"
        )
    if 0 < profile.token_vocab < BYTE_VOCAB:
        return "pretrain --synthetic --steps 100", (
            f"random tokens: the model's vocabulary of {profile.token_vocab} cannot hold the recipe's byte tokens"
        )
    return "pretrain", ""
