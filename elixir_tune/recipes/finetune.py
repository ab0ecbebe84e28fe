"""Fine-tune a causal language model (Hugging Face layout) on your data with elixir-tune.

    elixir-tune profile path/to/model --seq-len 512           # or a cached name: meta-llama/Llama-2-7b-hf
    elixir-tune search --gpus 4 --global-batch-size 32        # -> plan.yaml
    elixir-run plan.yaml finetune --model path/to/model --data chat.jsonl --packing --epochs 2 \\
        --eval-fraction 0.05 --eval-every 200 --save ckpt --keep-best --save-pretrained out/ --log-dir runs/tb

The model is built on the meta device from its config.json and its weights are read from its safetensors
straight into each rank's shards (``elixir_tune.setup(..., weights=DIR)``), so no rank ever holds the whole
model. ``--model`` (default: the plan's model.source) is a directory or a Hub name in the local Hugging Face
cache (never downloaded). Data (``elixir_tune.data``): a .txt file (packed into full windows, or one sample per
document, line or paragraph with ``--text-mode``), a JSON/JSONL/Parquet/CSV file or a saved ``datasets``
directory whose records have ``text``, ``prompt`` + ``completion`` (loss on the completion only) or ``messages``
(the tokenizer's chat template; loss on the assistant turns only); the format is detected from the fields and
printed; ``--packing`` puts several samples in a row without letting them attend to each other. LoRA:
``--lora-rank R`` wraps the meta model with PEFT's adapters before setup (the base frozen); profile with the same
``--lora-*`` options. Without ``--lora-*`` options the plan's LoRA settings (the profile's) are used. ``--save-pretrained OUT`` writes the weights, config, tokenizer files and generation config
into a new or empty directory, or over an earlier export (export_dir.py), at the end (with LoRA: the adapter in
PEFT's format, or with ``--merge-lora`` the merged model), so
``from_pretrained(OUT)`` loads it as it is. elixir-run calls ``preflight`` before any worker starts, so a wrong
path or a file that fits no format is one line, not a traceback per rank.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # transformers' notices would repeat once per rank

from elixir_tune.recipes import BUNDLED_TEXT  # noqa: E402
from elixir_tune.recipes.finetune_options import (  # noqa: E402
    add_data_args,
    add_lora_args,
    adopt_plan_lora,
    data_problems,
    lora_option_problems,
    lora_options,
    lora_plan_problem,
    padding_note,
    tokenizer_problem,
)
from elixir_tune.recipes.options import (  # noqa: E402
    OptionsError,
    RecipeParser,
    add_training_args,
    bundled_data_note,
    output_problems,
    parse_options,
    resolve_model_dir,
)

SCRIPT_NAME = "finetune"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def build_parser() -> RecipeParser:
    """The recipe's options."""
    import argparse

    parser = RecipeParser(
        prog="elixir-run PLAN finetune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_training_args(parser, lr=1e-4)
    parser.add_argument("--model", default=None, help="model directory or cached Hub name (default: plan's source)")
    add_data_args(parser, default_data=str(BUNDLED_TEXT))
    add_lora_args(parser)
    parser.add_argument(
        "--from-scratch",
        action="store_true",
        help="start from the model's own initializer instead of its weights (the directory needs none then)",
    )
    parser.add_argument(
        "--save-pretrained",
        default=None,
        metavar="DIR",
        help="write the model (with LoRA: the adapter, or the merged model with --merge-lora) here at the end",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file --save-pretrained writes")
    return parser


def has_tokenizer(model_dir: Path) -> bool:
    """Whether a model directory carries tokenizer files."""
    return any((model_dir / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: Path):
    """The directory's tokenizer, or None when it has none (bytes are the tokens then)."""
    if not has_tokenizer(model_dir):
        return None
    from transformers import AutoTokenizer

    # Never asked: a tokenizer folder with auto_map would otherwise prompt to run its code on a terminal.
    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)


def preflight(argv: list[str], plan_path: str) -> list[str]:
    """The inputs checked in elixir-run's process before any worker starts: one line per problem.

    Args:
        argv: the recipe's arguments.
        plan_path: the plan the job runs.

    Returns:
        Problems: options that do not parse, a model that does not resolve or has no config.json, a tokenizer
        that does not load or cannot render the data (no chat template for messages), a data file that is
        missing, does not parse or fits no format, packing under a plan that cannot carry it, a plan made for
        another model or other LoRA settings, a --resume on other data than its checkpoint's, a
        --save-pretrained directory holding files that are not an elixir-tune export, a logger not installed.
    """
    from elixir_tune.recipes.data_identity import resume_data_problem
    from elixir_tune.recipes.export_dir import export_dir_problem
    from elixir_tune.recipes.metrics import metric_problems

    try:
        args = parse_options(build_parser(), argv, for_preflight=True)
    except OptionsError as error:
        return [f"finetune: {error}"]
    import elixir_tune

    plan = elixir_tune.load_plan(plan_path)
    adopt_plan_lora(args, plan)
    problems = metric_problems(args) + output_problems(args) + lora_option_problems(args)
    problems += [
        problem for problem in (resume_data_problem(args), export_dir_problem(args.save_pretrained)) if problem
    ]
    found, data_format = data_problems(args, plan)
    problems += found
    try:
        model_dir = resolve_model_dir(args.model or plan.model.source, plan_path)
    except ValueError as error:
        return [*problems, str(error)]
    if any(problem.startswith("--data ") and problem.endswith(": no such file") for problem in found):
        # The tokenizer and the meta model cost seconds of imports (transformers, torch): a missing file is
        # answered at once, and those checks run once it is there.
        return problems
    try:
        tokenizer = load_tokenizer(model_dir)
    except Exception as error:  # transformers raises many kinds; the user needs the first line
        problems.append(f"{model_dir}: its tokenizer does not load: {str(error).strip().splitlines()[0][:200]}")
    else:
        unfit = tokenizer_problem(data_format, tokenizer)
        if unfit:
            problems.append(unfit)
    fit = plan_fit_problem(model_dir, plan, lora_options(args))
    if fit:
        problems.append(fit)
    return problems


def plan_fit_problem(model_dir: Path, plan, lora: dict | None = None) -> str | None:
    """Whether the plan was made for this model (its fingerprint: parameter names, shapes, dtypes) with these
    LoRA settings (``apply_lora``'s arguments, or None), built on meta."""
    import torch

    from elixir_tune.models.lora import LoraError, apply_lora, lora_settings
    from elixir_tune.plan import model_fingerprint
    from elixir_tune.profiler import ModelSourceError, load_model_source

    try:
        with torch.device("meta"):
            model = load_model_source(str(model_dir)).build_model()
    except (ModelSourceError, ValueError, ImportError) as error:
        return f"{model_dir}: cannot be built from its config.json: {error}"
    if lora is not None:
        try:
            model = apply_lora(model, **lora)
        except LoraError as error:
            return f"--lora-*: {error}"
    mismatch = lora_plan_problem(lora_settings(model), plan, model_dir)
    if mismatch:
        return mismatch
    found = model_fingerprint(model)
    if found != plan.model.fingerprint:
        return (
            f"the plan was made for another model (fingerprint {plan.model.fingerprint}, {model_dir} has {found}): "
            f"`elixir-tune profile {model_dir}` and search again"
        )
    return None


def write_usable_dir(model, model_dir: Path, args, rank: int) -> str:
    """``--save-pretrained``: the weights (collective), then the tokenizer files and generation config.

    Without LoRA the weights and config; with LoRA the adapter in PEFT's format (adapter_config.json +
    adapter_model.safetensors), or with ``--merge-lora`` the full model with the adapters merged.

    Returns:
        What was written, for the closing line.

    Raises:
        SaveError: on every rank, when rank 0 could not write (the message names the rank, the file
            or directory and the cause), or when the directory holds files that are not an elixir-tune
            export (export_dir.py; nothing is written): the ranks agree before any returns.
    """
    import elixir_tune
    from elixir_tune.engine.comm import shared_errors
    from elixir_tune.engine.io.pretrained_files import SaveError, describe_failure
    from elixir_tune.models.lora import save_adapter, save_merged
    from elixir_tune.recipes.export_dir import export_dir_problem, mark_export

    out = args.save_pretrained
    world = model.engine.mesh.world
    # The user's files may have come there while the run trained (the preflight found none): nothing replaces them.
    refused = shared_errors(world, export_dir_problem(out) if rank == 0 else None)
    if refused:
        raise SaveError(refused[0])
    error = None
    # Rank 0 writes the adapter, the merged model and the tokenizer files alone, after the last collective:
    # a failure there must reach the other ranks as well (shared_errors below), or they would exit 0.
    try:
        if lora_options(args) is None:
            elixir_tune.save_pretrained(model, out, max_shard_size=args.max_shard_size)
            written = "the model (load it with AutoModelForCausalLM.from_pretrained)"
        elif args.merge_lora:
            save_merged(model, out)
            written = "the model with the LoRA adapters merged (load it with AutoModelForCausalLM.from_pretrained)"
        else:
            save_adapter(model, out, base_model=_base_model_name(args.model, model_dir))
            written = f"the LoRA adapter (load it with PeftModel.from_pretrained(base, {out}))"
        if rank == 0:
            _write_tokenizer_files(model_dir, Path(out), args)
            mark_export(Path(out), SCRIPT_NAME, written)  # the next run may replace this export, and no other files
    except SaveError as failure:  # save_pretrained's: already the same on every rank
        error = str(failure)
    except Exception as failure:  # noqa: BLE001  (PEFT's, transformers' and the tokenizer's writers)
        error = f"rank {rank} could not write {out}: {describe_failure(failure)}"
    errors = shared_errors(world, error)
    if errors:
        raise SaveError("; ".join(errors))
    return written


def _base_model_name(spec: str | None, model_dir: Path) -> str:
    """What an adapter names as its base: the Hub name as given (it loads anywhere), else the directory's
    absolute path; PEFT's AutoPeftModelForCausalLM loads the base from it."""
    from elixir_tune.hf_cache import looks_like_hub_name

    return spec if spec and looks_like_hub_name(spec) else str(model_dir.resolve())


def _write_tokenizer_files(model_dir: Path, out: Path, args) -> None:
    """Rank 0: the source's tokenizer files and, for a full model, its generation config."""
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    source_generation = model_dir / "generation_config.json"
    if source_generation.is_file() and (lora_options(args) is None or args.merge_lora):
        # the source's sampling defaults win over the one derived from config
        shutil.copyfile(source_generation, out / "generation_config.json")


def main(argv: list[str] | None = None) -> int:
    """Runs the recipe on this worker (elixir-run starts one per rank)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    import elixir_tune
    from elixir_tune.data import DataError, load_data
    from elixir_tune.models.lora import LoraError, apply_lora
    from elixir_tune.profiler import load_model_source
    from elixir_tune.recipes.finetune_options import data_spec
    from elixir_tune.recipes.loop import fail_once, mark_process_start, train
    from elixir_tune.recipes.metrics import metric_problems
    from elixir_tune.recipes.options import plan_and_device
    from elixir_tune.recipes.settings_file import write_settings

    args = parse_options(build_parser(), sys.argv[1:] if argv is None else argv)
    plan_path, plan, device = plan_and_device()  # $ELIXIR_TUNE_PLAN, set by elixir-run
    adopt_plan_lora(args, plan)
    rank = int(os.environ.get("RANK", "0"))
    try:
        model_dir = resolve_model_dir(args.model or plan.model.source, plan_path)
    except ValueError as error:
        return fail_once(str(error), rank)
    problems = metric_problems(args) + lora_option_problems(args)
    if problems:
        return fail_once(problems[0], rank)
    write_settings(args, SCRIPT_NAME, rank)  # with the plan's LoRA; before train sets --steps from --epochs

    torch.manual_seed(args.seed)  # the initializer's seed with --from-scratch
    source = load_model_source(str(model_dir))
    with torch.device("meta"):  # shapes only: the weights go straight into the shards
        model = source.build_model()
        lora = lora_options(args)
        if lora is not None:  # PEFT's adapters on the meta model: setup puts the frozen base in frozen chunks
            try:
                model = apply_lora(model, **lora)
            except LoraError as error:
                return fail_once(str(error), rank)
    mark_process_start(model)  # what the run's memory is measured above, on the CPU (a meta model: 0 bytes)
    num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    try:
        model, optimizer = elixir_tune.setup(
            model, optimizer, plan=plan, weights=None if args.from_scratch else model_dir, seed=args.seed
        )
    except ValueError as error:  # the plan or the weights do not fit this model
        fail_once(f"elixir_tune.setup refused: {error}", rank)
        ErrorHandler().record_exception(error)
        return 1
    world = dist.get_world_size() if dist.is_initialized() else 1

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None and source.vocab_size is not None and source.vocab_size < 256:
        return fail_once(
            f"the model has no tokenizer and its vocabulary ({source.vocab_size}) is too small for bytes", rank
        )
    try:
        data = load_data(data_spec(args), tokenizer, plan.training.seq_len)
    except DataError as error:
        return fail_once(str(error), rank)
    if rank == 0:
        described = f"{type(tokenizer).__name__} ({len(tokenizer):,} tokens)" if tokenizer else "bytes (no tokenizer)"
        print(f"tokenizer: {described}", flush=True)
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
        # padding_note encodes every training sample once (describe() reuses the counts): rank 0 alone
        notes=[note for note in (bundled_data_note(args), padding_note(data, plan) if rank == 0 else None) if note],
    )
    if code == 0 and args.save_pretrained:
        from elixir_tune.engine.io.pretrained_files import SaveError

        try:
            written = write_usable_dir(model, model_dir, args, rank)
        except SaveError as error:  # every rank has the same one-line error; the checkpoints are kept
            code = fail_once(str(error), rank)
        else:
            if rank == 0:
                print(f"wrote {args.save_pretrained}: {written}", flush=True)
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    from elixir_tune.worker_exit import exit_worker

    # record: an unexpected error reaches elixir-run's failure report, not only this rank's output
    exit_worker(record(main)())
