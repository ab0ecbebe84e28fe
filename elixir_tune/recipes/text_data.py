"""Today's text data for the recipes, with the shape of the fine-tuning data interface (``TrainData``).

Every source here has ``describe()``, ``num_samples()``, ``batch(step, global_batch_size, data_rank, data_size)``
(this data-parallel rank's rows of the step's global batch, which every rank draws alike from the seed and the
step), ``epoch(step, global_batch_size)`` and ``eval_batches(batch_size)`` (the held-out split in order, or None):

    TextPieces    fine-tuning: paragraphs (blank lines between them) tokenized with the model's tokenizer (or
                  bytes), cut into pieces of at most seq_len and right-padded (mask 0, labels -100 on padding);
                  the samples are visited in a seeded permutation per epoch.
    ByteWindows   pretraining: the bytes of a file are the tokens; random windows of seq_len.
    RandomTokens  pretraining for speed: uniformly random tokens, no evaluation.

``load_training_data`` is the one entry the fine-tuning recipe calls (the richer data formats replace it).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from pathlib import Path

import torch

Batch = dict[str, torch.Tensor]


class DataProblem(ValueError):
    """The data cannot be used (one line: what is wrong and what to do)."""


def rows_of(global_batch: Batch, data_rank: int, data_size: int) -> Batch:
    """This data rank's rows ``[rank x per, (rank + 1) x per)`` of a global batch."""
    per = next(iter(global_batch.values())).shape[0] // data_size
    return {key: value[data_rank * per : (data_rank + 1) * per] for key, value in global_batch.items()}


class TextPieces:
    """Token pieces of 2..seq_len tokens, right-padded, visited in a seeded permutation per epoch."""

    def __init__(
        self,
        pieces: list[list[int]],
        seq_len: int,
        pad_id: int,
        seed: int,
        name: str,
        eval_pieces: list[list[int]] | None = None,
    ):
        if not pieces:
            raise DataProblem(f"{name}: no text to train on (after holding out the evaluation split)")
        self.pieces, self.seq_len, self.pad_id, self.seed, self.name = pieces, seq_len, pad_id, seed, name
        self.eval_pieces = eval_pieces or None
        self.format = "text"

    def describe(self) -> str:
        held_out = f", {len(self.eval_pieces):,} held out for eval" if self.eval_pieces else ""
        return f"{self.name}, {len(self.pieces):,} pieces of up to {self.seq_len} tokens{held_out}"

    def num_samples(self) -> int:
        return len(self.pieces)

    def epoch(self, step: int, global_batch_size: int) -> float:
        return step * global_batch_size / len(self.pieces)

    def _order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.pieces), generator=generator).tolist()

    def batch(self, step: int, global_batch_size: int, data_rank: int, data_size: int) -> Batch:
        per = global_batch_size // data_size
        first = step * global_batch_size + data_rank * per  # this rank's first sample of the run's sequence
        orders: dict[int, list[int]] = {}
        picks = []
        for index in range(first, first + per):
            epoch, offset = divmod(index, len(self.pieces))
            picks.append(orders.setdefault(epoch, self._order(epoch))[offset])
        return self._padded([self.pieces[i] for i in picks])

    def eval_batches(self, batch_size: int) -> Iterator[Batch] | None:
        if not self.eval_pieces:
            return None
        pieces = self.eval_pieces
        return (self._padded(pieces[begin : begin + batch_size]) for begin in range(0, len(pieces), batch_size))

    def _padded(self, pieces: list[list[int]]) -> Batch:
        ids = torch.full((len(pieces), self.seq_len), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(pieces), self.seq_len), dtype=torch.long)
        for row, piece in enumerate(pieces):
            ids[row, : len(piece)] = torch.tensor(piece, dtype=torch.long)
            mask[row, : len(piece)] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class ByteWindows:
    """Random windows of ``seq_len`` byte tokens; evaluation on consecutive windows of a held-out tail."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int, name: str, eval_tokens: torch.Tensor | None):
        if tokens.numel() <= seq_len:
            raise DataProblem(f"{name}: {tokens.numel()} tokens to train on, fewer than seq_len {seq_len} + 1")
        self.tokens, self.seq_len, self.seed, self.name = tokens, seq_len, seed, name
        self.eval_tokens = eval_tokens if eval_tokens is not None and eval_tokens.numel() >= seq_len else None
        self.format = "text"

    def describe(self) -> str:
        held_out = f", {self.eval_tokens.numel():,} held out for eval" if self.eval_tokens is not None else ""
        return f"{self.name}, {self.tokens.numel():,} byte tokens{held_out}"

    def num_samples(self) -> int:
        return self.tokens.numel() // self.seq_len

    def epoch(self, step: int, global_batch_size: int) -> float:
        return step * global_batch_size / self.num_samples()

    def global_batch(self, step: int, size: int) -> Batch:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (size,), generator=generator)
        ids = torch.stack([self.tokens[start : start + self.seq_len] for start in starts.tolist()])
        return {"input_ids": ids, "labels": ids}

    def batch(self, step: int, global_batch_size: int, data_rank: int, data_size: int) -> Batch:
        return rows_of(self.global_batch(step, global_batch_size), data_rank, data_size)

    def eval_batches(self, batch_size: int) -> Iterator[Batch] | None:
        if self.eval_tokens is None:
            return None
        windows = self.eval_tokens[: self.eval_tokens.numel() // self.seq_len * self.seq_len].view(-1, self.seq_len)
        return ({"input_ids": w, "labels": w} for w in windows.split(batch_size))


class RandomTokens:
    """Uniformly random tokens (for throughput runs; the loss stays near ln(vocab)); no evaluation split."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.format = "synthetic"

    def describe(self) -> str:
        return "synthetic"

    def num_samples(self) -> int:
        raise DataProblem("random tokens have no epochs: give --steps with --synthetic")

    def epoch(self, step: int, global_batch_size: int) -> float:
        return 0.0

    def global_batch(self, step: int, size: int) -> Batch:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        ids = torch.randint(0, self.vocab_size, (size, self.seq_len), generator=generator)
        return {"input_ids": ids, "labels": ids}

    def batch(self, step: int, global_batch_size: int, data_rank: int, data_size: int) -> Batch:
        return rows_of(self.global_batch(step, global_batch_size), data_rank, data_size)

    def eval_batches(self, batch_size: int) -> Iterator[Batch] | None:
        return None


def read_text(path: str, option: str = "--data") -> str:
    """A data file's text (one-line DataProblem naming ``option`` when it is missing or a directory)."""
    file = Path(path)
    if not file.is_file():
        raise DataProblem(f"{option} {path}: no such file" + (" (a directory)" if file.is_dir() else ""))
    return file.read_text(errors="replace")


def split_off_eval(samples: list, fraction: float, seed: int) -> tuple[list, list]:
    """(training, evaluation): a seeded ``fraction`` of the samples held out (at least one when fraction > 0)."""
    if fraction <= 0:
        return samples, []
    generator = torch.Generator().manual_seed(seed * 7919 + 17)
    order = torch.randperm(len(samples), generator=generator).tolist()
    held = max(1, math.floor(len(samples) * fraction))
    return [samples[i] for i in sorted(order[held:])], [samples[i] for i in sorted(order[:held])]


def paragraph_pieces(text: str, tokenizer, seq_len: int, vocab_size: int | None) -> list[list[int]]:
    """Paragraphs tokenized (EOS appended; bytes without a tokenizer), cut into pieces of 2..seq_len tokens."""
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    if tokenizer is not None:
        eos = tokenizer.eos_token_id
        encoded = [
            tokenizer(p, add_special_tokens=True)["input_ids"] + ([eos] if eos is not None else []) for p in paragraphs
        ]
    else:
        encoded = [list(p.encode()) for p in paragraphs]
    top = max((max(ids) for ids in encoded if ids), default=0)
    if vocab_size is not None and top >= vocab_size:
        raise DataProblem(
            f"token id {top} is outside the model's vocabulary ({vocab_size}): tokenizer and model differ"
        )
    pieces = [ids[i : i + seq_len] for ids in encoded for i in range(0, len(ids), seq_len)]
    return [p for p in pieces if len(p) >= 2]


def load_training_data(args: argparse.Namespace, tokenizer, seq_len: int, vocab_size: int | None = None) -> TextPieces:
    """The fine-tuning recipe's data: ``--data`` cut into paragraph pieces, with the evaluation split asked for.

    Args:
        args: the recipe's options (``data``, ``eval_fraction``, ``eval_data``, ``seed``).
        tokenizer: a transformers tokenizer, or None (bytes are the tokens).
        seq_len: the plan's sequence length.
        vocab_size: the model's vocabulary, to refuse a tokenizer that does not fit it.

    Returns:
        The training data and its held-out split.

    Raises:
        DataProblem: a missing file, no text, a tokenizer that does not fit the model.
    """
    if tokenizer is None and vocab_size is not None and vocab_size < 256:
        raise DataProblem(f"the model has no tokenizer and its vocabulary ({vocab_size}) is too small for bytes")
    pad_id = 0
    if tokenizer is not None:
        eos = tokenizer.eos_token_id
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    pieces = paragraph_pieces(read_text(args.data), tokenizer, seq_len, vocab_size)
    pieces, eval_pieces = split_off_eval(pieces, args.eval_fraction, args.seed)
    if args.eval_data:
        eval_pieces = paragraph_pieces(read_text(args.eval_data, "--eval-data"), tokenizer, seq_len, vocab_size)
    return TextPieces(pieces, seq_len, pad_id, args.seed, str(args.data), eval_pieces)
