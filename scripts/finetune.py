"""Fine-tune a causal language model directory (Hugging Face layout) on a text file with elixir-tune.

The model is built on the meta device from DIR/config.json and its weights are read from DIR's
safetensors straight into each rank's shards (``elixir_tune.setup(..., weights=DIR)``), so no rank
ever holds the whole model. The flow for a downloaded model:

    elixir-tune profile path/to/model --seq-len 512            # -> profile.yaml (config only)
    elixir-tune search --gpus 4 --global-batch-size 32         # -> plan.yaml
    elixir-run plan.yaml scripts/finetune.py --model path/to/model --data corpus.txt \\
        --steps 1000 --save ckpt --save-every 200 --save-pretrained out/
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('out/')"

Data: the text is cut into paragraphs (blank lines between them); each paragraph is tokenized with
DIR's tokenizer when DIR has one (its bytes are the tokens otherwise), longer ones are cut into
seq_len pieces, and every step draws a global batch of random pieces, the same on every rank.
Pieces are right-padded to the plan's seq_len: the attention mask is 0 and the labels -100 on the
padding, so it neither attends nor counts in the loss. Progress, logging, checkpoints and resume are
those of train_gpt2.py (scripts/training_loop.py); ``--save-pretrained DIR`` writes the fine-tuned
weights in Hugging Face layout at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # training_loop, also when run through runpy

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record  # noqa: E402
from training_loop import add_training_args, plan_and_device, resolve_model_spec, train  # noqa: E402

import elixir_tune  # noqa: E402
from elixir_tune.profiler import load_model_source  # noqa: E402

REPO_DIR = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_DIR / "data" / "public_domain.txt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_args(parser, lr=1e-4)
    parser.add_argument("--model", default=None, help="model directory (default: the plan's model.source)")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="text file to fine-tune on")
    parser.add_argument(
        "--from-scratch",
        action="store_true",
        help="start from the model's own initializer instead of DIR's weights (DIR needs none then)",
    )
    parser.add_argument("--save-pretrained", default=None, metavar="DIR", help="write the weights here at the end")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file --save-pretrained writes")
    return parser.parse_args()


class PieceSampler:
    """Random token pieces of at most ``seq_len``, right-padded, with attention masks and masked labels.

    The global batch of a step depends only on the seed and the step: every rank draws the same one.
    """

    def __init__(self, pieces: list[list[int]], seq_len: int, pad_id: int, seed: int):
        if not pieces:
            raise SystemExit("the data has no text to train on")
        self.pieces, self.seq_len, self.pad_id, self.seed = pieces, seq_len, pad_id, seed

    def global_batch(self, step: int, size: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        picks = torch.randint(0, len(self.pieces), (size,), generator=generator).tolist()
        ids = torch.full((size, self.seq_len), self.pad_id, dtype=torch.long)
        mask = torch.zeros((size, self.seq_len), dtype=torch.long)
        for row, index in enumerate(picks):
            piece = self.pieces[index]
            ids[row, : len(piece)] = torch.tensor(piece, dtype=torch.long)
            mask[row, : len(piece)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def tokenize(text: str, model_dir: Path, seq_len: int, vocab_size: int | None) -> tuple[list[list[int]], int, str]:
    """Paragraphs as token pieces of 2..seq_len tokens; returns (pieces, pad id, tokenizer description)."""
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    if any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
        encoded = [
            tokenizer(p, add_special_tokens=True)["input_ids"] + ([eos] if eos is not None else []) for p in paragraphs
        ]
        described = f"{type(tokenizer).__name__} ({len(tokenizer):,} tokens)"
    else:
        if vocab_size is not None and vocab_size < 256:
            raise SystemExit(f"{model_dir} has no tokenizer and its vocabulary ({vocab_size}) is too small for bytes")
        encoded = [list(p.encode()) for p in paragraphs]
        pad, described = 0, "bytes (the directory has no tokenizer)"
    top = max((max(ids) for ids in encoded if ids), default=0)
    if vocab_size is not None and top >= vocab_size:
        raise SystemExit(f"token id {top} is outside the model's vocabulary ({vocab_size}): tokenizer and model differ")
    pieces = [ids[i : i + seq_len] for ids in encoded for i in range(0, len(ids), seq_len)]
    return [p for p in pieces if len(p) >= 2], pad, described


@record  # an unexpected error reaches elixir-run's failure report, not only this rank's output
def main() -> int:
    args = parse_args()
    plan_path, plan, device = plan_and_device()  # $ELIXIR_TUNE_PLAN, set by elixir-run
    model_dir = Path(resolve_model_spec(args.model or plan.model.source, plan_path))
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"--model {model_dir}: not a model directory (no config.json)")

    torch.manual_seed(args.seed)  # the initializer's seed with --from-scratch
    source = load_model_source(str(model_dir))
    with torch.device("meta"):  # shapes only: the weights go straight into the shards
        model = source.build_model()
    num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    try:
        model, optimizer = elixir_tune.setup(
            model, optimizer, plan=plan, weights=None if args.from_scratch else model_dir, seed=args.seed
        )
    except ValueError as error:  # the plan or the weights do not fit this model
        if os.environ.get("RANK", "0") == "0":
            print(f"error: elixir_tune.setup refused: {error}", file=sys.stderr, flush=True)
        ErrorHandler().record_exception(error)
        return 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1

    data = Path(args.data)
    pieces, pad_id, tokenizer = tokenize(
        data.read_text(errors="replace"), model_dir, plan.training.seq_len, source.vocab_size
    )
    if rank == 0:
        print(f"data: {data}, {len(pieces):,} pieces of up to {plan.training.seq_len} tokens, {tokenizer}", flush=True)
    sampler = PieceSampler(pieces, plan.training.seq_len, pad_id, args.seed)
    code = train(
        args,
        model,
        optimizer,
        plan,
        sampler,
        script="finetune.py",
        model_name=source.name,
        num_params=num_params,
        data_name=str(data),
        device=device,
        rank=rank,
        world=world,
    )
    if code == 0 and args.save_pretrained:
        elixir_tune.save_pretrained(model, args.save_pretrained, max_shard_size=args.max_shard_size)
        if rank == 0:
            print(f"wrote {args.save_pretrained} (load it with transformers' from_pretrained)", flush=True)
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
