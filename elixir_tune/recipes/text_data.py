"""The pretraining recipe's data, with the shape of the fine-tuning data (``elixir_tune.data.TrainData``).

Every source here has ``describe()``, ``num_samples()``, ``batch(step, global_batch_size, data_rank, data_size)``
(this data-parallel rank's rows of the step's global batch, which every rank draws alike from the seed and the
step), ``epoch(step, global_batch_size)`` and ``eval_batches(batch_size)`` (the held-out split in order, or None):

    ByteWindows   pretraining: the bytes of a file are the tokens; random windows of seq_len.
    RandomTokens  pretraining for speed: uniformly random tokens, no evaluation.

The fine-tuning recipe reads its data through ``elixir_tune.data`` (formats, masks, packing).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

Batch = dict[str, torch.Tensor]


class DataProblem(ValueError):
    """The data cannot be used (one line: what is wrong and what to do)."""


def rows_of(global_batch: Batch, data_rank: int, data_size: int) -> Batch:
    """This data rank's rows ``[rank x per, (rank + 1) x per)`` of a global batch."""
    per = next(iter(global_batch.values())).shape[0] // data_size
    return {key: value[data_rank * per : (data_rank + 1) * per] for key, value in global_batch.items()}


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
