"""Which samples a step's batch holds on each data-parallel rank, epochs, and the held-out share.

Step ``s`` of global batch size ``B`` reads the global positions ``s*B .. (s+1)*B - 1`` of an
endless stream; position ``g`` is sample ``permutation(epoch)[offset]`` with ``epoch, offset =
divmod(g, N)``, the permutation of an epoch seeded by (seed, epoch). So each sample is seen once per
epoch, a batch may straddle two epochs, and the stream depends only on (N, seed). Data rank ``r``
of ``D`` takes positions ``r*B/D .. (r+1)*B/D - 1`` of the batch: the slice of the global batch.
"""

from __future__ import annotations

from elixir_tune.data.formats import DataError


def rank_positions(step: int, global_batch_size: int, data_rank: int, data_size: int) -> range:
    """The global stream positions of this data rank's rows at ``step``.

    Raises:
        DataError: the global batch does not split evenly over the data ranks, or bad arguments.
    """
    if step < 0 or global_batch_size < 1 or data_size < 1 or not 0 <= data_rank < data_size:
        raise DataError(
            f"batch(step={step}, global_batch_size={global_batch_size}, data_rank={data_rank}, "
            f"data_size={data_size}): need step >= 0, a positive batch and 0 <= data_rank < data_size"
        )
    if global_batch_size % data_size:
        raise DataError(
            f"global batch size {global_batch_size} does not split over {data_size} data-parallel ranks: "
            "make it a multiple of the data-parallel size"
        )
    per_rank = global_batch_size // data_size
    first = step * global_batch_size + data_rank * per_rank
    return range(first, first + per_rank)


class EpochOrder:
    """The seeded permutation of each epoch, the last few kept (a step reads at most two epochs)."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed = num_samples, seed
        self._cache: dict[int, list[int]] = {}

    def sample_at(self, position: int) -> int:
        """The sample index at a global stream position."""
        epoch, offset = divmod(position, self.num_samples)
        return self.permutation(epoch)[offset]

    def permutation(self, epoch: int) -> list[int]:
        """The order of the samples in ``epoch``."""
        if epoch not in self._cache:
            import torch

            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            if len(self._cache) >= 4:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = torch.randperm(self.num_samples, generator=generator).tolist()
        return self._cache[epoch]


def split_eval(num_samples: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Training and held-out sample indices, each in order; the held-out ones chosen by the seed.

    Args:
        num_samples: the samples to split.
        eval_fraction: the held-out share (at least one sample when positive).
        seed: which ones.

    Raises:
        DataError: nothing would be left to train on.
    """
    if eval_fraction <= 0:
        return list(range(num_samples)), []
    import torch

    held_out = max(1, round(num_samples * eval_fraction))
    if held_out >= num_samples:
        raise DataError(
            f"eval fraction {eval_fraction} of {num_samples} samples leaves none to train on: "
            "lower it or give an eval file"
        )
    generator = torch.Generator().manual_seed(seed * 1_000_003 + 999_983)
    chosen = set(torch.randperm(num_samples, generator=generator)[:held_out].tolist())
    return [i for i in range(num_samples) if i not in chosen], sorted(chosen)
