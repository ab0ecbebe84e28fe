"""``load_data``: a data file into the batches of a run, each data-parallel rank tokenizing only its rows.

The samples (records, lines, paragraphs, or packed text windows) are encoded lazily, one by one, as
a rank's batches need them, with a small cache: a rank tokenizes only its share. Two cases need
every sample's length and encode all samples once at load: ``text_mode=pack`` (the windows are
cut from the whole token stream) and ``packing=True`` (the rows are grouped by length).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from elixir_tune.data.chat import check_chat_tokenizer, encode_messages
from elixir_tune.data.formats import DataError, DataInfo, DataSpec, check_spec, read_data
from elixir_tune.data.packing import Encoded, best_fit_bins, packed_rows, padded_rows
from elixir_tune.data.prompt_completion import IGNORE, encode_prompt_completion
from elixir_tune.data.sampling import EpochOrder, rank_positions, split_eval
from elixir_tune.data.text import encode_text, pack_windows, text_units

CACHE_SAMPLES = 4096


class Samples:
    """A list of samples encoded on demand (LRU-cached): ``encode(i)`` gives (input ids, labels)."""

    def __init__(self, items: Sequence[Any], encoder: Callable[[Any], Encoded]):
        self.items, self.encoder = items, encoder
        self._cache: OrderedDict[int, Encoded] = OrderedDict()

    def __len__(self) -> int:
        return len(self.items)

    def encode(self, index: int) -> Encoded:
        """Sample ``index``'s input ids and labels (uncut)."""
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        encoded = self.encoder(self.items[index])
        self._cache[index] = encoded
        if len(self._cache) > CACHE_SAMPLES:
            self._cache.popitem(last=False)
        return encoded

    def subset(self, indices: list[int]) -> Samples:
        """The samples at ``indices``, in that order."""
        return Samples([self.items[i] for i in indices], self.encoder)


class TrainData:
    """The training samples (and the eval split) of a run, cut into seq_len rows."""

    def __init__(self, spec: DataSpec, info: DataInfo, train: Samples, eval: Samples | None, seq_len: int, pad_id: int):
        self.spec, self.info, self.format, self.train, self.eval = spec, info, info.format, train, eval
        self.seq_len, self.pad_id = seq_len, pad_id
        self.rows: list[list[int]] | None = None  # packed rows of sample indices (packing=True)
        if spec.packing and not (self.format == "text" and spec.text_mode == "pack"):
            lengths = [min(len(train.encode(i)[0]), seq_len) for i in range(len(train))]
            self.rows = best_fit_bins(lengths, seq_len)
        self._order = EpochOrder(self.num_samples(), spec.seed)
        self._stats: dict[str, int] | None = None

    @property
    def packed(self) -> bool:
        """Whether rows hold several samples (then batches carry position_ids and no attention_mask)."""
        return self.rows is not None

    def num_samples(self) -> int:
        """Training rows a global batch draws from: samples, or packed rows with ``packing``."""
        return len(self.rows) if self.rows is not None else len(self.train)

    def batch(self, step: int, global_batch_size: int, data_rank: int, data_size: int) -> dict[str, Any]:
        """This data-parallel rank's rows of the step's global batch (the slice of the global batch).

        Args:
            step: the optimizer step (0-based).
            global_batch_size: rows of the global batch, a multiple of ``data_size``.
            data_rank: this rank's data-parallel index.
            data_size: the number of data-parallel ranks.

        Returns:
            ``input_ids``, ``labels`` (-100 where no loss), and ``attention_mask`` (padded rows) or
            ``position_ids`` (packed rows), each [global_batch_size // data_size, seq_len] long.

        Raises:
            DataError: the batch does not split over the ranks, or a sample cannot be encoded.
        """
        picks = [
            self._order.sample_at(position)
            for position in rank_positions(step, global_batch_size, data_rank, data_size)
        ]
        if self.rows is None:
            return padded_rows([self.train.encode(i) for i in picks], self.seq_len, self.pad_id)
        return packed_rows([[self.train.encode(i) for i in self.rows[row]] for row in picks], self.seq_len, self.pad_id)

    def epoch(self, step: int, global_batch_size: int) -> float:
        """The fractional epoch reached after ``step`` steps of ``global_batch_size`` rows."""
        return step * global_batch_size / self.num_samples()

    def eval_batches(self, batch_size: int, data_rank: int = 0, data_size: int = 1) -> Iterator[dict[str, Any]] | None:
        """The eval split in order, ``batch_size`` padded rows at a time, or this data rank's share of it.

        With ``data_size`` > 1 rank r takes the r-th of ``data_size`` contiguous, equal shares; the
        last shares are filled up with blank rows (one pad token, no labels) so that every rank runs
        the same number of batches of the same size (the engine's collectives need that). Weight
        each batch's loss by its loss tokens, ``(labels[:, 1:] != -100).sum()``: a batch of blank
        rows has none (and the model's mean loss over none is NaN).

        Args:
            batch_size: rows per batch (the last batch may be fewer).
            data_rank: this rank's data-parallel index.
            data_size: the number of data-parallel ranks.

        Returns:
            An iterator of batches (keys as ``batch`` for padded rows), or None without an eval split.

        Raises:
            DataError: a batch size below 1, or a data rank outside [0, data_size).
        """
        if self.eval is None:
            return None
        if batch_size < 1 or data_size < 1 or not 0 <= data_rank < data_size:
            raise DataError(
                f"eval_batches(batch_size={batch_size}, data_rank={data_rank}, data_size={data_size}): need a "
                "positive batch size and 0 <= data_rank < data_size"
            )
        held_out = self.eval
        share = -(-len(held_out) // data_size)
        first = data_rank * share
        blank: Encoded = ([self.pad_id], [IGNORE])

        def batches() -> Iterator[dict[str, Any]]:
            for start in range(first, first + share, batch_size):
                indices = range(start, min(start + batch_size, first + share))
                samples = [held_out.encode(i) if i < len(held_out) else blank for i in indices]
                yield padded_rows(samples, self.seq_len, self.pad_id)

        return batches()

    def stats(self) -> dict[str, int]:
        """Counts over the training samples (encodes every sample once; cached).

        ``rows`` is the rows an epoch computes, each seq_len tokens long (the samples, or the packed rows), and
        ``packed_rows`` the rows best-fit packing makes of the same samples: the padding share of the rows is
        ``1 - tokens / (rows x seq_len)``, with packing ``1 - tokens / (packed_rows x seq_len)``.
        """
        if self._stats is None:
            encoded = [self.train.encode(i) for i in range(len(self.train))]
            lengths = [len(ids) for ids, _ in encoded]
            kept = [min(length, self.seq_len) for length in lengths]
            # the tokens the shifted loss predicts: a row's first label never counts
            loss_tokens = sum(1 for _, labels in encoded for label in labels[1 : self.seq_len] if label != IGNORE)
            self._stats = {
                "samples": len(lengths),
                "tokens": sum(kept),
                "loss_tokens": loss_tokens,
                "truncated": sum(1 for length in lengths if length > self.seq_len),
                "rows": self.num_samples(),
                "packed_rows": len(self.rows) if self.rows is not None else len(best_fit_bins(kept, self.seq_len)),
            }
        return self._stats

    def describe(self) -> str:
        """One line for the run's log: file, format, samples, tokens, truncation, packing, eval split.

        Counting tokens and truncations encodes every training sample once (on the calling rank).
        """
        stats = self.stats()
        how = "given" if self.spec.format != "auto" else "plain text file"
        if self.spec.format == "auto" and self.info.fields:
            how = "detected from fields " + ", ".join(self.info.fields)
        mode = f", text mode {self.spec.text_mode}" if self.format == "text" else ""
        line = (
            f"data: {self.spec.path}: {self.format} ({how}{mode}), {stats['samples']:,} samples, {stats['tokens']:,} tokens "
            f"({stats['loss_tokens']:,} with loss), {stats['truncated']:,} truncated to {self.seq_len}"
        )
        if self.rows is not None:
            line += f", packed into {len(self.rows):,} rows"
        elif self.spec.packing:
            line += " (packing: the text windows are full already)"
        if self.eval is not None:
            source = self.spec.eval_path or f"{self.spec.eval_fraction:g} held out"
            line += f"; eval: {len(self.eval):,} samples ({source})"
        return line


def load_data(spec: DataSpec, tokenizer: Any, seq_len: int) -> TrainData:
    """Read, check and prepare the data of a run (``inspect_data``'s checks included).

    Args:
        spec: the data and how to cut it.
        tokenizer: a transformers tokenizer, or None: then plain text only, its bytes as tokens.
        seq_len: the row length.

    Returns:
        The training data, ready for ``batch``.

    Raises:
        DataError: everything ``inspect_data`` raises; a format that needs a tokenizer without one;
            a tokenizer without a chat template for messages; no samples.
    """
    check_spec(spec)
    if seq_len < 2:
        raise DataError(f"sequence length {seq_len} is too short to learn from: give at least 2")
    info, dataset = read_data(spec.path, spec.format, spec.text_mode)
    if info.format != "text" and tokenizer is None:
        raise DataError(f"{spec.path}: format {info.format} needs the model's tokenizer; the model directory has none")
    if info.format == "messages":
        check_chat_tokenizer(tokenizer)
    train = _samples(info.format, dataset, spec, tokenizer, seq_len, spec.path)
    held_out = None
    if spec.eval_path is not None:
        eval_info, eval_dataset = read_data(spec.eval_path, info.format, spec.text_mode)
        held_out = _samples(eval_info.format, eval_dataset, spec, tokenizer, seq_len, spec.eval_path)
    elif spec.eval_fraction > 0:
        train_indices, eval_indices = split_eval(len(train), spec.eval_fraction, spec.seed)
        train, held_out = train.subset(train_indices), train.subset(eval_indices)
    pad_id = _pad_id(tokenizer)
    return TrainData(spec, info, train, held_out, seq_len, pad_id)


def _samples(format: str, dataset: Any, spec: DataSpec, tokenizer: Any, seq_len: int, path: str) -> Samples:
    if format == "text":
        documents = list(dataset["text"])
        if spec.text_mode == "pack":
            windows = pack_windows(tokenizer, documents, seq_len)
            samples = Samples(windows, lambda ids: (ids, ids))
        else:
            samples = Samples(text_units(documents, spec.text_mode), lambda text: _same(encode_text(tokenizer, text)))
    elif format == "prompt_completion":
        samples = Samples(
            range(len(dataset)),
            lambda i: encode_prompt_completion(tokenizer, dataset[i]["prompt"], dataset[i]["completion"]),
        )
    else:
        samples = Samples(range(len(dataset)), lambda i: encode_messages(tokenizer, dataset[i]["messages"], i))
    if len(samples) == 0:
        raise DataError(f"{path}: no text to train on (text mode {spec.text_mode})")
    return samples


def _same(ids: list[int]) -> Encoded:
    return ids, ids


def _pad_id(tokenizer: Any) -> int:
    if tokenizer is None:
        return 0
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0
