"""Samples into seq_len rows: padded one per row, or packed several per row.

Padded: a sample is cut to seq_len (its start kept) and right-padded; padding has
``attention_mask`` 0 and label -100.

Packed (``packing=True``): the samples are grouped into rows by best-fit decreasing on their
lengths (each row holds samples whose lengths sum to at most seq_len; the grouping depends only on
the lengths, so every rank computes the same rows). In a row:

- ``position_ids`` restart at 0 at each sample (and at the padding after the last), so rotary or
  learned positions are those of the sample alone;
- each sample keeps its own labels, and the label of its first token is -100: the model's shifted
  loss would otherwise predict a sample's first token from the previous sample's last;
- the row has no 2D ``attention_mask``. transformers (5.x) then reads the restarting
  ``position_ids`` as packed sequences and builds a block-diagonal causal mask (eager, sdpa and
  flex attention; flash-attention takes the sequence boundaries from the same ``position_ids``), so
  no token attends to another sample. ``block_causal_mask`` builds the same mask as a 4D additive
  tensor, for a model that needs it passed as ``attention_mask``.
"""

from __future__ import annotations

import bisect
from typing import Any

from elixir_tune.data.prompt_completion import IGNORE

Encoded = tuple[list[int], list[int]]  # (input ids, labels)


def best_fit_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sample indices grouped into rows of at most ``capacity`` tokens (best-fit decreasing).

    Each sample, longest first, goes into the row with the least free space that still fits it.
    The rows are kept in buckets by free space, and the distinct free spaces (at most capacity + 1
    of them) in a sorted list: a sample costs a bisection, also for 10^5 samples and more.

    Args:
        lengths: each sample's length (at most ``capacity``).
        capacity: the row length (seq_len).

    Returns:
        The rows, each a list of sample indices in the order they sit in the row; every sample in
        exactly one row.
    """
    rows: list[list[int]] = []
    spaces: list[int] = []  # the distinct free spaces of the open rows, sorted
    buckets: dict[int, list[int]] = {}  # free space -> rows with that much free

    def put(row: int, space: int) -> None:
        if space <= 0:
            return  # a full row takes nothing more
        if space not in buckets:
            buckets[space] = []
            bisect.insort(spaces, space)
        buckets[space].append(row)

    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        slot = bisect.bisect_left(spaces, length)
        if slot == len(spaces):
            rows.append([index])
            put(len(rows) - 1, capacity - length)
            continue
        space = spaces[slot]
        row = buckets[space].pop()
        if not buckets[space]:
            del buckets[space]
            spaces.pop(slot)
        rows[row].append(index)
        put(row, space - length)
    return rows


def padded_rows(samples: list[Encoded], seq_len: int, pad_id: int) -> dict[str, Any]:
    """One sample per row, cut to seq_len and right-padded.

    Returns:
        ``input_ids``, ``labels`` (-100 on padding) and ``attention_mask`` (0 on padding), [rows, seq_len] long.
    """
    import torch

    ids = torch.full((len(samples), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), seq_len), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(samples), seq_len), dtype=torch.long)
    for row, (sample_ids, sample_labels) in enumerate(samples):
        length = min(len(sample_ids), seq_len)
        ids[row, :length] = torch.tensor(sample_ids[:length], dtype=torch.long)
        labels[row, :length] = torch.tensor(sample_labels[:length], dtype=torch.long)
        mask[row, :length] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def packed_rows(rows: list[list[Encoded]], seq_len: int, pad_id: int) -> dict[str, Any]:
    """Several samples per row, each cut to seq_len, positions restarting at each.

    Returns:
        ``input_ids``, ``labels`` and ``position_ids``, [rows, seq_len] long (no attention_mask:
        see the module's docstring).

    Raises:
        ValueError: a row's samples are longer than seq_len together.
    """
    import torch

    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), IGNORE, dtype=torch.long)
    positions = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for row, samples in enumerate(rows):
        start = 0
        for sample_ids, sample_labels in samples:
            length = min(len(sample_ids), seq_len)
            if start + length > seq_len:
                raise ValueError(f"packed row {row} holds more than {seq_len} tokens")
            ids[row, start : start + length] = torch.tensor(sample_ids[:length], dtype=torch.long)
            labels[row, start + 1 : start + length] = torch.tensor(sample_labels[1:length], dtype=torch.long)
            positions[row, start : start + length] = torch.arange(length)
            start += length
        positions[row, start:] = torch.arange(seq_len - start)  # the padding: a sequence of its own
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def block_causal_mask(position_ids: Any, dtype: Any) -> Any:
    """The 4D additive attention mask of packed rows: causal within each sample, nothing across.

    Args:
        position_ids: [rows, seq_len], restarting at 0 where a sample starts.
        dtype: the attention's dtype (the model's compute dtype).

    Returns:
        [rows, 1, seq_len, seq_len]: 0 where a token may attend, the dtype's lowest value elsewhere.
    """
    import torch

    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    segment = starts.cumsum(dim=1)  # which sample each token belongs to
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (segment[:, :, None] == segment[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
