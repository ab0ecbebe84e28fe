"""Train a causal LM from its initializer with elixir-tune, on the bundled public-domain text (or yours).

    elixir-run plan.yaml pretrain --steps 200 --log runs/train.json
    elixir-run plan.yaml pretrain --synthetic --steps 20                     # random tokens, for speed
    elixir-run plan.yaml pretrain --steps 200 --save ckpt --save-every 50
    elixir-run plan.yaml pretrain --steps 200 --resume ckpt --save ckpt      # continues exactly

The model is the plan's model.source (a config name such as gpt2-tiny, a model .yaml or .py, or a Hugging Face
config) unless ``--model`` names another. Data: the bytes of a text file are the tokens (vocabulary 256, nothing
to download); every step draws a global batch of random windows, the same on every rank, and each data-parallel
rank trains on its rows. Batching comes from the plan: global batch = micro-batch x accumulation x data-parallel
degree. Progress, the JSON log, evaluation (``--eval-fraction`` holds out the end of the text), checkpoints
(--save; Ctrl-C or SIGTERM to elixir-run saves, then it exits 128 + the signal: 130 or 143) and --resume are
those of every recipe (loop.py).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # transformers' notices would repeat once per rank

from elixir_tune.recipes import BUNDLED_TEXT  # noqa: E402
from elixir_tune.recipes.options import (  # noqa: E402
    OptionsError,
    RecipeParser,
    add_training_args,
    bundled_data_note,
    output_problems,
    parse_options,
    resolve_model_spec,
)

SCRIPT_NAME = "pretrain"


def build_parser() -> RecipeParser:
    """The recipe's options."""
    import argparse

    parser = RecipeParser(
        prog="elixir-run PLAN pretrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_training_args(parser)
    parser.add_argument("--synthetic", action="store_true", help="random tokens instead of the text")
    parser.add_argument("--data", default=str(BUNDLED_TEXT), help="text file; its bytes are the tokens")
    parser.add_argument("--model", default=None, help="model spec (default: the plan's model.source)")
    return parser


def preflight(argv: list[str], plan_path: str) -> list[str]:
    """The inputs checked in elixir-run's process before any worker starts: one line per problem.

    Args:
        argv: the recipe's arguments.
        plan_path: the plan the job runs.

    Returns:
        Problems: options that do not parse, a missing data file, a --resume on other data than its checkpoint's,
        a model spec that does not resolve, a logger that is not installed.
    """
    from pathlib import Path

    try:  # first: --help and a bad option answer at once, before the imports of torch below
        args = parse_options(build_parser(), argv, for_preflight=True)
    except OptionsError as error:
        return [f"pretrain: {error}"]
    import elixir_tune
    from elixir_tune.profiler import ModelSourceError, check_model_source
    from elixir_tune.recipes.data_identity import resume_data_problem
    from elixir_tune.recipes.metrics import metric_problems

    problems = metric_problems(args) + output_problems(args)
    data_problem = resume_data_problem(args)
    if data_problem:
        problems.append(data_problem)
    if not args.synthetic:
        for option, path in (("--data", args.data), ("--eval-data", args.eval_data)):
            if path and not Path(path).is_file():
                problems.append(f"{option} {path}: no such file")
            elif path and Path(path).stat().st_size == 0:
                problems.append(f"{option} {path}: the file is empty; give a text file (its bytes are the tokens)")
    plan = elixir_tune.load_plan(plan_path)
    try:  # read, never imported: a plan from someone else runs no code before the user starts the job
        check_model_source(resolve_model_spec(args.model or plan.model.source, plan_path))
    except ModelSourceError as error:
        problems.append(str(error))
    return problems


def load_data(args, seq_len: int, vocab_size: int | None):
    """Random tokens (``--synthetic``) or the bytes of ``--data``, with the evaluation split asked for."""
    import torch

    from elixir_tune.recipes.text_data import ByteWindows, DataProblem, RandomTokens

    if args.synthetic:
        if args.eval_fraction or args.eval_data:
            raise DataProblem("--synthetic has no evaluation split: drop --eval-fraction/--eval-data")
        if not vocab_size:
            raise DataProblem("--synthetic needs the model's vocabulary size (model.config.vocab_size)")
        return RandomTokens(vocab_size, seq_len, args.seed)
    if vocab_size is not None and vocab_size < 256:
        raise DataProblem(
            f"byte-level text needs a vocabulary of at least 256, the model has {vocab_size}; use --synthetic"
        )

    def read(path: str, option: str) -> torch.Tensor:
        if not os.path.isfile(path):
            raise DataProblem(f"{option} {path}: no such file")
        with open(path, "rb") as file:
            content = file.read()
        if not content:  # torch.frombuffer raises on an empty buffer
            raise DataProblem(f"{option} {path}: the file is empty; give a text file (its bytes are the tokens)")
        return torch.frombuffer(bytearray(content), dtype=torch.uint8).long()

    tokens = read(args.data, "--data")
    eval_tokens = None
    if args.eval_fraction:
        cut = tokens.numel() - int(tokens.numel() * args.eval_fraction)
        tokens, eval_tokens = tokens[:cut], tokens[cut:]
    elif args.eval_data:
        eval_tokens = read(args.eval_data, "--eval-data")
    return ByteWindows(tokens, seq_len, args.seed, args.data, eval_tokens)


def main(argv: list[str] | None = None) -> int:
    """Runs the recipe on this worker (elixir-run starts one per rank)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    import elixir_tune
    from elixir_tune.profiler import load_model_source
    from elixir_tune.profiler.arch import token_vocab
    from elixir_tune.recipes.loop import fail_once, mark_process_start, train
    from elixir_tune.recipes.metrics import metric_problems
    from elixir_tune.recipes.options import plan_and_device
    from elixir_tune.recipes.settings_file import write_settings
    from elixir_tune.recipes.text_data import DataProblem

    args = parse_options(build_parser(), sys.argv[1:] if argv is None else argv)
    plan_path, plan, device = plan_and_device()  # $ELIXIR_TUNE_PLAN, set by elixir-run
    rank = int(os.environ.get("RANK", "0"))
    if metric_problems(args):
        return fail_once(metric_problems(args)[0], rank)
    write_settings(args, SCRIPT_NAME, rank)  # before anything changes args (train sets --steps from --epochs)

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    source = load_model_source(resolve_model_spec(args.model or plan.model.source, plan_path))
    model = source.build_model()
    mark_process_start(model)  # what the run's memory is measured above, on the CPU
    num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    vocab_size = source.vocab_size or token_vocab(model) or None  # a model file's own: its embedding's rows
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    try:
        model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
    except ValueError as error:  # the plan does not fit this model (fingerprint, parameters, memory)
        fail_once(f"elixir_tune.setup refused the plan: {error}", rank)
        ErrorHandler().record_exception(error)  # elixir-run's failure report quotes it
        return 1

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != plan.world_size:
        return fail_once(
            f"the plan is for {plan.world_size} processes but this job has {world}; start it with elixir-run", rank
        )
    try:
        data = load_data(args, plan.training.seq_len, vocab_size)
    except DataProblem as error:
        return fail_once(str(error), rank)
    code = train(
        args,
        model,
        optimizer,
        plan,
        data,
        script=SCRIPT_NAME,
        model_name=source.name,
        num_params=num_params,
        device=device,
        rank=rank,
        world=world,
        notes=[note for note in (bundled_data_note(args),) if note],
    )
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    from elixir_tune.worker_exit import exit_worker

    # record: an unexpected error reaches elixir-run's failure report, not only this rank's output
    exit_worker(record(main)())
