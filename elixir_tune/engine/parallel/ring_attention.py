"""Ring attention (``parallel.context.mode: ring``): keys and values travel around the context group.

Each rank holds chunks ``r`` and ``2C - 1 - r`` of 2C of every sequence (the load-balanced causal split
of ``balanced_tokens``). Its queries stay; the key/value blocks pass from rank to rank, C steps in all.
At each step the next block is already in flight (``ring_pass``) while attention runs on the block in
hand, and the partial outputs are merged by their log-sum-exp (the online softmax). Only the
(query chunk, key chunk) pairs that the causal mask and sliding window leave any visible key in are
computed: every rank does the same work, and a window shorter than a chunk skips whole blocks.

The attention is computed here, blockwise, in the form of transformers' eager functions (scores
scaled, soft-capped, masked, a float32 softmax), whichever of ``sdpa`` or ``eager`` the model uses:
neither kernel returns the log-sum-exp the merge needs. Masks: causal by position, the layer's
sliding window (key j seen from query i when i - window < j <= i) and the padding of the keys.

Backward is a custom ``autograd.Function`` that runs the ring again: the key/value blocks travel as
in forward, each with the gradient its earlier holders accumulated, and after C steps every block's
gradient arrives at its owner. Each block's scores are recomputed (nothing of size queries x keys is
kept between forward and backward) and differentiated by autograd against the forward's final
log-sum-exp, so soft-capping, masks and grouped key/value heads need no hand-written derivative.

torch's own experimental ``context_parallel`` (its distributed tensor package) is not used: it dispatches the
CUDA flash, efficient and cuDNN kernels only (not the CPU one, so not gloo), with ``is_causal`` and no
mask, so neither padding, sliding windows nor soft-capping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elixir_tune.engine.comm import Comm, Handle
from elixir_tune.engine.comm.context import ring_pass

_KV_TAG, _GRAD_TAG = 0, 1  # the two passes between the same ranks in backward


@dataclass
class RingSpec:
    """What one layer's ring attention needs besides its states.

    Attributes:
        comm: the context group (rank r holds chunks r and 2C - 1 - r).
        length: the whole sequence's length (a multiple of 2C).
        padding: (batch, length), True where a token is real; None: no padding.
        scaling: the factor on the scores.
        softcap: soft-capping of the scores (Gemma2), or None.
        window: sliding-window span, or None.
    """

    comm: Comm
    length: int
    padding: torch.Tensor | None
    scaling: float
    softcap: float | None
    window: int | None

    @property
    def chunk(self) -> int:
        return self.length // (2 * self.comm.world_size)

    def chunk_starts(self, rank: int) -> tuple[int, int]:
        """The first positions of rank ``rank``'s two chunks."""
        size = self.comm.world_size
        return rank * self.chunk, (2 * size - 1 - rank) * self.chunk

    def visible(self, query_start: int, key_start: int) -> bool:
        """Whether any query of the chunk at ``query_start`` sees any key of the chunk at ``key_start``."""
        last = self.chunk - 1
        if key_start > query_start + last:
            return False  # every key after every query
        return self.window is None or key_start + last > query_start - self.window

    def whole(self, query_start: int, key_start: int) -> bool:
        """Whether every query of the chunk at ``query_start`` sees every key of the chunk at
        ``key_start`` (padding aside): such a pair needs no mask, decided without a device sync."""
        last = self.chunk - 1
        return key_start + last <= query_start and (self.window is None or key_start > query_start + last - self.window)

    def mask(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """(batch or 1, 1, queries, keys): True where query position i sees key position j."""
        allowed = keys[None, :] <= queries[:, None]
        if self.window is not None:
            allowed = allowed & (keys[None, :] > queries[:, None] - self.window)
        allowed = allowed[None, None]
        if self.padding is not None:
            allowed = allowed & self.padding[:, keys][:, None, None, :]
        return allowed


def _repeat_heads(states: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped key/value heads repeated to the query heads (each kv head serves heads / kv_heads)."""
    groups = heads // states.shape[1]
    return states if groups == 1 else states.repeat_interleave(groups, dim=1)


def _scores(spec: RingSpec, query, key, query_pos, key_pos) -> torch.Tensor:
    """Float32 scores (batch, heads, queries, keys): scaled, soft-capped, masked (to float32's minimum)
    where ``query_pos`` is not None."""
    scores = torch.matmul(query, _repeat_heads(key, query.shape[1]).transpose(-1, -2)).float() * spec.scaling
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if query_pos is not None:
        # A row with no allowed key (a padded query) attends uniformly, as under transformers' additive mask.
        scores = scores.masked_fill(~spec.mask(query_pos, key_pos), torch.finfo(torch.float32).min)
    return scores


def _pairs(spec: RingSpec, source: int, device: torch.device):
    """For each of this rank's query chunks that sees any of the block from ``source``: (its rows,
    the block's visible key tokens, and the query and key positions, both None where no key needs a mask).

    A query chunk sees one or both of the block's two chunks: the visible keys are one slice.
    """
    chunk, rank = spec.chunk, spec.comm.rank
    key_starts = spec.chunk_starts(source)
    for index, query_start in enumerate(spec.chunk_starts(rank)):
        seen = [k for k, key_start in enumerate(key_starts) if spec.visible(query_start, key_start)]
        if not seen:
            continue
        rows, keys = slice(index * chunk, (index + 1) * chunk), slice(seen[0] * chunk, (seen[-1] + 1) * chunk)
        if spec.padding is None and all(spec.whole(query_start, key_starts[k]) for k in seen):
            yield rows, keys, None, None
            continue
        query_pos = torch.arange(query_start, query_start + chunk, device=device)
        key_pos = torch.cat([torch.arange(key_starts[k], key_starts[k] + chunk, device=device) for k in seen])
        yield rows, keys, query_pos, key_pos


def _split(flat: torch.Tensor, key_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    half = flat.numel() // 2
    return flat[:half].view(key_shape), flat[half:].view(key_shape)


def _ring_forward(spec: RingSpec, query, key, value) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (float32, like ``query``'s layout) and log-sum-exp (batch, heads, local) of the whole ring."""
    size, rank = spec.comm.world_size, spec.comm.rank
    batch, heads, local, dim = query.shape
    out = query.new_zeros(batch, heads, local, dim, dtype=torch.float32)
    lse = query.new_full((batch, heads, local), float("-inf"), dtype=torch.float32)
    block = torch.cat([key.reshape(-1), value.reshape(-1)])
    for step in range(size):
        if step < size - 1:
            following, handle = ring_pass(spec.comm, block, _KV_TAG)  # in flight while this block is computed
        block_key, block_value = _split(block, key.shape)
        for rows, key_index, query_pos, key_pos in _pairs(spec, (rank - step) % size, query.device):
            scores = _scores(spec, query[:, :, rows], block_key[:, :, key_index], query_pos, key_pos)
            block_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - block_lse[..., None])
            block_out = torch.matmul(probs, _repeat_heads(block_value[:, :, key_index], heads).float())
            merged = torch.logaddexp(lse[:, :, rows], block_lse)  # the first step sees itself: never -inf twice
            out[:, :, rows] = (
                out[:, :, rows] * torch.exp(lse[:, :, rows] - merged)[..., None]
                + block_out * torch.exp(block_lse - merged)[..., None]
            )
            lse[:, :, rows] = merged
        if step < size - 1:
            handle.wait()
            block = following
    return out, lse


def _block_grads(spec: RingSpec, source: int, query, key, value, grad_out, lse, rowdot):
    """The gradients of the query, key and value from one block (recomputed with autograd).

    The output is sum over blocks of exp(scores - lse) @ value; lse depends on the scores too, which
    adds -rowdot x exp(scores - lse) to the scores' gradient (rowdot = rowsum(grad_out * out)): that is
    the gradient of the probabilities' row sums with weight -rowdot, taken in the same call.
    """
    query, key, value = (t.detach().requires_grad_() for t in (query, key, value))
    outputs, weights = [], []
    with torch.enable_grad():
        for rows, key_index, query_pos, key_pos in _pairs(spec, source, query.device):
            scores = _scores(spec, query[:, :, rows], key[:, :, key_index], query_pos, key_pos)
            probs = torch.exp(scores - lse[:, :, rows, None])
            outputs += [
                torch.matmul(probs, _repeat_heads(value[:, :, key_index], query.shape[1]).float()),
                probs.sum(-1),
            ]
            weights += [grad_out[:, :, rows], -rowdot[:, :, rows]]
        if not outputs:
            return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        grads = torch.autograd.grad(outputs, (query, key, value), weights, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (query, key, value), strict=True))


def _ring_backward(spec: RingSpec, query, key, value, out, lse, grad_out):
    size, rank = spec.comm.world_size, spec.comm.rank
    grad_out = grad_out.float()
    rowdot = (grad_out * out).sum(-1)
    grad_query = torch.zeros_like(query)
    block = torch.cat([key.reshape(-1), value.reshape(-1)])
    carried: tuple[torch.Tensor, Handle] | None = None  # the gradient in flight and its handle
    for step in range(size):
        if step < size - 1:
            following, handle = ring_pass(spec.comm, block, _KV_TAG)
        block_key, block_value = _split(block, key.shape)
        d_query, d_key, d_value = _block_grads(
            spec, (rank - step) % size, query, block_key, block_value, grad_out, lse, rowdot
        )
        grad_query += d_query
        block_grad = torch.cat([d_key.reshape(-1), d_value.reshape(-1)])
        if carried is not None:
            carried[1].wait()  # the gradient this block gathered on the ranks that held it before
            block_grad += carried[0]
        # To the rank that holds this block next; after the last step, to its owner.
        carried = ring_pass(spec.comm, block_grad, _GRAD_TAG)
        if step < size - 1:
            handle.wait()
            block = following
    assert carried is not None
    carried[1].wait()
    grad_key, grad_value = _split(carried[0], key.shape)
    return grad_query, grad_key, grad_value


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, spec: RingSpec):
        out, lse = _ring_forward(spec, query, key, value)
        ctx.spec = spec
        ctx.save_for_backward(query, key, value, out, lse)
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        return (*_ring_backward(ctx.spec, query, key, value, out, lse, grad_out), None)


def ring_attention(spec: RingSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values (differentiable).

    Args:
        spec: the layer's group, masks and score transform.
        query: (batch, heads, local, head_dim), this rank's two chunks in order.
        key, value: (batch, kv_heads, local, head_dim), the same tokens; kv_heads divides heads.

    Returns:
        (batch, local, heads, head_dim), ``query``'s dtype (transformers' attention output layout).
    """
    key, value = key.contiguous(), value.contiguous()
    return _RingAttention.apply(query.contiguous(), key, value, spec).transpose(1, 2)
