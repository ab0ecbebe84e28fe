"""The fine-tuning recipe's data and LoRA options, and the checks on them that elixir-run's preflight runs.

Data: ``--data``, ``--format``, ``--text-mode``, ``--packing``, ``--eval-fraction`` and ``--eval-data`` map to
``elixir_tune.data.DataSpec`` (``data_spec``); ``data_problems`` runs ``inspect_data`` (the file parses and fits a
format) and the checks that need the tokenizer or the plan: messages need a chat template, the non-text formats a
tokenizer, and packed rows (``position_ids``, no ``attention_mask``) reach the model under data-parallel, pipeline
and 1D tensor plans (each pipeline stage passes the micro-batch's position ids to the model), not under a 2D one. LoRA: ``--lora-rank R`` (> 0 turns it on), ``--lora-alpha``, ``--lora-dropout``, ``--lora-targets``
give ``apply_lora``'s arguments (``lora_options``); the plan's ``model.lora`` must be what they give, since the
profile and the search priced that model (``lora_plan_problem``); ``lora_flags`` writes a profile's settings back
as these options (search prints them). Nothing heavy is imported at module level.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from elixir_tune.data import DataError, DataSpec, inspect_data
from elixir_tune.data.formats import FORMATS, TEXT_MODES


def add_data_args(parser: argparse.ArgumentParser, default_data: str) -> None:
    """``--data``, ``--format``, ``--text-mode`` and ``--packing`` (the eval options are every recipe's)."""
    parser.add_argument(
        "--data",
        default=default_data,
        help="a .txt file, a JSON/JSONL/Parquet/CSV file of records (text, prompt+completion or messages), "
        "or a datasets.save_to_disk directory",
    )
    parser.add_argument(
        "--format",
        default="auto",
        choices=("auto", *FORMATS),
        help="the data format (default: detected from the records' fields, and printed)",
    )
    parser.add_argument(
        "--text-mode",
        default="pack",
        choices=TEXT_MODES,
        help="text: pack (documents joined and cut into full seq_len windows), or one sample per "
        "document, line or paragraph",
    )
    parser.add_argument(
        "--packing",
        action="store_true",
        help="put several samples in one row, each attending only to itself (position_ids restart per sample)",
    )


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """``--lora-rank`` and its companions, as ``elixir-tune profile`` takes them, plus ``--merge-lora``."""
    parser.add_argument(
        "--lora-rank", type=int, default=0, metavar="R", help="train LoRA adapters of rank R on a frozen base (0: off)"
    )
    parser.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2 x rank)")
    parser.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    parser.add_argument(
        "--lora-targets", default=None, metavar="A,B", help="modules to adapt, e.g. q_proj,v_proj (default: PEFT's)"
    )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="with --save-pretrained: write a full model with the adapters merged instead of the adapter alone",
    )


def lora_option_problems(args: argparse.Namespace) -> list[str]:
    """LoRA options that contradict each other (each a line saying what to add or drop)."""
    problems = []
    if args.lora_rank < 0:
        problems.append(f"--lora-rank must be 0 (no LoRA) or more, not {args.lora_rank}")
    given = [f"--{name}" for name in ("lora-alpha", "lora-targets") if getattr(args, name.replace("-", "_"))]
    if args.lora_dropout:
        given.append("--lora-dropout")
    if args.merge_lora:
        given.append("--merge-lora")
    if args.lora_rank == 0 and given:
        verb = "needs" if len(given) == 1 else "need"
        problems.append(
            f"{', '.join(given)} {verb} --lora-rank R (e.g. 8): add it, or drop {'it' if len(given) == 1 else 'them'}"
        )
    if args.merge_lora and not args.save_pretrained:
        problems.append("--merge-lora writes the merged model to --save-pretrained DIR: add --save-pretrained")
    return problems


def adopt_plan_lora(args: argparse.Namespace, plan) -> None:
    """Without any ``--lora-*`` option, the plan's LoRA settings (the profile's) become the options: a plan
    made for LoRA runs without repeating them. Given options stay, and ``lora_plan_problem`` checks them."""
    planned = dict(getattr(plan.model, "lora", None) or {})
    if not planned or args.lora_rank or args.lora_alpha is not None or args.lora_targets or args.lora_dropout:
        return
    args.lora_rank, args.lora_alpha = int(planned["rank"]), float(planned["alpha"])
    args.lora_dropout = float(planned.get("dropout") or 0.0)
    targets = planned.get("target_modules")
    args.lora_targets = ",".join(targets) if isinstance(targets, list) else targets


def lora_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """``apply_lora``'s keyword arguments from the options, or None without ``--lora-rank``."""
    if args.lora_rank <= 0:
        return None
    return {
        "rank": args.lora_rank,
        "alpha": args.lora_alpha,
        "dropout": args.lora_dropout,
        "target_modules": args.lora_targets,
    }


def lora_flags(settings: dict[str, Any]) -> str:
    """A plan's or profile's ``lora`` settings as the recipe's options (what ``profile --lora-*`` was given).

    Args:
        settings: ``rank``, ``alpha``, ``dropout`` and ``target_modules`` (``elixir_tune.models.lora.lora_settings``).

    Returns:
        ``--lora-rank 8 --lora-alpha 16 --lora-targets q_proj,v_proj`` (dropout only when not 0).
    """
    flags = f"--lora-rank {settings['rank']} --lora-alpha {float(settings['alpha']):g}"
    if settings.get("dropout"):
        flags += f" --lora-dropout {float(settings['dropout']):g}"
    return flags + f" --lora-targets {','.join(settings['target_modules'])}"


def lora_plan_problem(found: dict[str, Any], plan, model_dir: Path) -> str | None:
    """Whether the options' LoRA (``found``: ``lora_settings`` of the model they build) is the plan's.

    Args:
        found: the LoRA settings the options give ({} without LoRA).
        plan: the plan the job runs.
        model_dir: the model, for the profile command in the message.

    Returns:
        None when they agree; otherwise one line with the options that fit the plan.
    """
    planned = dict(plan.model.lora or {})
    if found == planned:
        return None
    if not planned:
        return (
            "the plan was made without LoRA: profile with the same options (`elixir-tune profile "
            f"{model_dir} {lora_flags(found)}`) and search again, or drop the --lora-* options"
        )
    if not found:
        return f"the plan was made for LoRA: add {lora_flags(planned)} (or profile and search without LoRA)"
    return (
        f"the plan was made for LoRA {lora_flags(planned)}, the options give {lora_flags(found)}: use the plan's, "
        "or profile with the same --lora-* options and search again"
    )


def data_spec(args: argparse.Namespace) -> DataSpec:
    """The recipe's data options as ``elixir_tune.data.DataSpec``."""
    return DataSpec(
        path=str(args.data),
        format=args.format,
        text_mode=args.text_mode,
        packing=args.packing,
        eval_fraction=args.eval_fraction,
        eval_path=args.eval_data,
        seed=args.seed,
    )


def data_problems(args: argparse.Namespace, plan) -> tuple[list[str], str | None]:
    """The data checks that need no tokenizer: the files exist, parse and fit a format; packing fits the plan.

    Args:
        args: the recipe's options.
        plan: the plan the job runs.

    Returns:
        (one line per problem, the detected format or None when the data does not read).
    """
    missing = [
        f"{option} {path}: no such file"
        for option, path in (("--data", args.data), ("--eval-data", args.eval_data))
        if path and not Path(path).exists()
    ]
    problems = list(missing)
    if args.packing and plan.parallel.tensor.degree > 1 and plan.parallel.tensor.mode == "2d":
        problems.append(
            "--packing: a 2D tensor plan does not carry the packed rows' position_ids; search for a 1D tensor "
            "or data-parallel plan, or drop --packing"
        )
    if missing:
        return problems, None
    try:
        info = inspect_data(data_spec(args))
    except DataError as error:
        return [*problems, str(error)], None
    return problems, info.format


def padding_note(data, plan) -> str | None:
    """The line that says how much of the rows' compute is padding and, when packing would waste less, that
    ``--packing`` would pack them: short chats padded to seq_len are mostly padding, and nothing else says so.

    Args:
        data: the run's ``TrainData``; the figures come from every training sample's real length (``stats``).
        plan: the plan the job runs (a 2D tensor plan cannot carry packed rows).

    Returns:
        The line, or None for text cut into full windows (``--text-mode pack``: nothing to pad).
    """
    if data.format == "text" and data.spec.text_mode == "pack":
        return None
    stats, seq_len = data.stats(), data.seq_len

    def padding(rows: int) -> str:
        return f"{1 - stats['tokens'] / (rows * seq_len):.0%}"

    if data.packed:
        return (
            f"rows: {stats['samples']:,} samples packed into {stats['rows']:,} rows of {seq_len} tokens: "
            f"{padding(stats['rows'])} of the tokens computed are padding"
        )
    line = f"rows are padded to {seq_len} tokens: {padding(stats['rows'])} of the tokens computed are padding"
    if stats["packed_rows"] < stats["rows"]:
        line += (
            f"; --packing would pack the {stats['samples']:,} samples into {stats['packed_rows']:,} rows "
            f"({padding(stats['packed_rows'])} padding)"
        )
        if plan.parallel.tensor.degree > 1 and plan.parallel.tensor.mode == "2d":
            line += " under a data-parallel or 1D tensor plan"
    return line


def tokenizer_problem(data_format: str | None, tokenizer) -> str | None:
    """A format the tokenizer cannot serve: no tokenizer for records, no chat template for messages."""
    from elixir_tune.data.chat import check_chat_tokenizer

    if data_format in (None, "text"):
        return None
    try:
        if tokenizer is None:
            raise DataError(f"format {data_format} needs the model's tokenizer; the model directory has none")
        if data_format == "messages":
            check_chat_tokenizer(tokenizer)
    except DataError as error:
        return str(error)
    return None
