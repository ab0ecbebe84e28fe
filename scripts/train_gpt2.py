"""Train a GPT-2 (or any causal LM a plan names) with elixir-tune, on a bundled public-domain text.

Run it under elixir-run, which starts one process per GPU (or CPU worker) as the plan says and
tells each one where the plan is ($ELIXIR_TUNE_PLAN):

    elixir-run plan.yaml scripts/train_gpt2.py --steps 200 --log runs/train.json
    elixir-run plan.yaml scripts/train_gpt2.py --synthetic --steps 20      # random tokens, for speed
    elixir-run plan.yaml scripts/train_gpt2.py --steps 200 --save ckpt --save-every 50
    elixir-run plan.yaml scripts/train_gpt2.py --steps 200 --resume ckpt --save ckpt   # continues exactly

Data: the bytes of a text file are the tokens (vocabulary 256, nothing to download); every step
draws a global batch of random windows, the same on every rank, and each rank trains on its own
slice of it. Batching comes from the plan: global batch = micro-batch x accumulation x world size.
Rank 0 shows a progress bar (loss, tokens/s, TFLOPS, memory) and writes a JSON log of every step.
Checkpoints (--save) are sharded (elixir_tune.save_checkpoint); with --save, Ctrl-C or SIGTERM
finishes the current step on every rank, saves, and exits 130. --resume continues at the saved step:
the data and the LR schedule (a function of the step and --steps) go on exactly as if never stopped.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# transformers' notices (e.g. about the default loss) would repeat once per rank; errors still show.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # training_loop, also when run through runpy

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record  # noqa: E402
from training_loop import (  # noqa: E402
    SyntheticSampler,
    WindowSampler,
    add_training_args,
    plan_and_device,
    resolve_model_spec,
    train,
)

import elixir_tune  # noqa: E402
from elixir_tune.profiler import load_model_source  # noqa: E402

REPO_DIR = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_DIR / "data" / "public_domain.txt"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_args(parser)
    parser.add_argument("--synthetic", action="store_true", help="random tokens instead of the text")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="text file; its bytes are the tokens")
    parser.add_argument("--model", default=None, help="model spec (default: the plan's model.source)")
    return parser.parse_args()


@record  # an unexpected error reaches elixir-run's failure report, not only this rank's output
def main() -> int:
    args = parse_args()
    plan_path, plan, device = plan_and_device()  # $ELIXIR_TUNE_PLAN, set by elixir-run
    training = plan.training

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    source = load_model_source(resolve_model_spec(args.model or plan.model.source, plan_path))
    model = source.build_model()
    num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    vocab_size = source.vocab_size or getattr(getattr(model, "config", None), "vocab_size", None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    try:
        model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
    except ValueError as error:  # the plan does not fit this model (fingerprint, parameters, memory)
        if os.environ.get("RANK", "0") == "0":
            print(f"error: elixir_tune.setup refused the plan: {error}", file=sys.stderr, flush=True)
        ErrorHandler().record_exception(error)  # elixir-run's failure report quotes it
        return 1

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != plan.world_size:
        raise SystemExit(
            f"the plan is for {plan.world_size} processes but this job has {world}; start it with elixir-run"
        )

    if args.synthetic:
        if not vocab_size:
            raise SystemExit("--synthetic needs the model's vocabulary size (model.config.vocab_size)")
        sampler = SyntheticSampler(vocab_size, training.seq_len, args.seed)
        data_name = "synthetic"
    else:
        if vocab_size is not None and vocab_size < 256:
            raise SystemExit(
                f"byte-level text needs a vocabulary of at least 256, the model has {vocab_size}; use --synthetic"
            )
        data = Path(args.data)
        tokens = torch.frombuffer(bytearray(data.read_bytes()), dtype=torch.uint8).long()
        sampler = WindowSampler(tokens, training.seq_len, args.seed)
        data_name = str(data)

    code = train(
        args,
        model,
        optimizer,
        plan,
        sampler,
        script="train_gpt2.py",
        model_name=source.name,
        num_params=num_params,
        data_name=data_name,
        device=device,
        rank=rank,
        world=world,
    )
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
